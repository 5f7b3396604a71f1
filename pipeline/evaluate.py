"""Stage ``evaluate``: decode valid and test with the averaged model and score against the raw references.

Beam size and α are chosen on the valid set only: one decode per beam size, every α re-ranked
from its finished set, valid BLEU (13a cased) reported for the whole grid; the test set is then
decoded once with the chosen (beam, α). Hypotheses are detokenised with the model's own
SentencePiece model and scored against the untouched ``<paths.raw>/{valid,test}.de`` (never
cleaned or BPE-decoded text) with sacreBLEU's five figures and the paper's tokenized,
compound-split BLEU (:mod:`pipeline.inference.scoring`). Every line of both sets is kept: an empty source
gives an empty hypothesis line.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.core.config import EvaluateConfig, Params
from pipeline.core.errors import DataError
from pipeline.core.stage import stage_main
from pipeline.core.textio import read_lines, write_lines
from pipeline.data.shards import ShardSet
from pipeline.inference import model_file
from pipeline.inference.decoding import Translator, decode_sources, detokenize, load_translator, prepare_source
from pipeline.inference.scoring import METRIC_KEYS, primary_bleu, score_files

log = logging.getLogger(__name__)

SETS = ("valid", "test")
TARGET_LANG = "de"


def load_sources(shards_dir: str | Path, split: str, translator: Translator) -> tuple[list[list[int]], int]:
    """Model sources of a valid/test split, in line order, and how many were truncated.

    Raises:
        DataError: shards from another BPE model, or a split that lost lines (ids not 0..n-1).
    """
    shards = ShardSet(shards_dir, split)
    actual = hashlib.sha256(translator.spm_bytes).hexdigest()
    if shards.manifest["spm_sha256"] != actual:
        raise DataError(
            f"{Path(shards_dir) / 'manifest.json'} was encoded with spm.model sha256 {shards.manifest['spm_sha256']}"
            f", but the model's embedded spm.model has sha256 {actual}; `dvc repro` to rebuild shards and model"
        )
    sources, truncated = [], 0
    for expected, (row_id, src, _tgt) in enumerate(shards.iter_rows()):
        if row_id != expected:
            raise DataError(f"{shards_dir}: split {split!r} lacks line {expected} (next id {row_id}); valid and "
                            "test must keep every line: rerun `dvc repro encode`")
        source, cut = prepare_source(src.tolist(), translator.config)
        sources.append(source)
        truncated += cut
    if truncated:
        log.warning("%s: %d source(s) longer than max_positions %d were truncated", split, truncated,
                    translator.config.max_positions)
    return sources, truncated


def _references(raw_dir: str | Path, split: str, n_sources: int, shards_dir: str | Path) -> tuple[Path, list[str]]:
    ref_path = Path(raw_dir) / f"{split}.{TARGET_LANG}"
    if not ref_path.is_file():
        raise DataError(f"{ref_path}: reference missing; run `dvc repro download`")
    refs = list(read_lines(ref_path))
    if len(refs) != n_sources:
        raise DataError(f"{ref_path} has {len(refs)} lines but the {split} shards in {shards_dir} hold {n_sources} "
                        "sentences: the set must keep all its lines; rerun `dvc repro clean encode`")
    return ref_path, refs


def choose_on_valid(cfg: EvaluateConfig, translator: Translator, sources: list[list[int]],
                    refs: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """Decode valid once per beam size, rank every α; returns (grid, chosen entry, chosen hypotheses).

    The chosen entry has the highest valid BLEU; ties go to the earlier grid entry (beam sizes and
    α in params order).
    """
    grid: list[dict[str, Any]] = []
    best: tuple[float, dict[str, Any], list[str]] | None = None
    for beam in cfg.beam_sizes:
        start = time.monotonic()
        by_alpha = decode_sources(translator, sources, beam_size=beam, alphas=cfg.alphas, max_len_a=cfg.max_len_a,
                                  max_len_b=cfg.max_len_b, max_tokens=cfg.max_tokens, label="valid")
        seconds = time.monotonic() - start
        for alpha in cfg.alphas:
            text = detokenize(translator, by_alpha[float(alpha)])
            entry = {"beam": beam, "alpha": float(alpha), "bleu": primary_bleu(text, refs),
                     "decode_seconds": round(seconds, 3)}
            grid.append(entry)
            log.info("valid beam %d alpha %.2f: BLEU %.2f", beam, alpha, entry["bleu"])
            if best is None or entry["bleu"] > best[0]:
                best = (entry["bleu"], entry, text)
    assert best is not None  # cfg guarantees a non-empty grid
    return grid, best[1], best[2]


def _set_report(hyp_path: Path, ref_path: Path, *, seconds: float, beam: int, alpha: float,
                truncated: int) -> dict[str, Any]:
    report = score_files(hyp_path, ref_path, TARGET_LANG)
    n = report["sentences"]
    report.update(decode_seconds=round(seconds, 3), sentences_per_second=round(n / max(seconds, 1e-9), 2),
                  beam=beam, alpha=alpha, truncated_sources=truncated, hypotheses=str(hyp_path),
                  reference=str(ref_path))
    return report


def stage(cfg: EvaluateConfig, *, model_dir: str | Path, shards_dir: str | Path, raw_dir: str | Path,
          eval_dir: str | Path) -> dict:
    """Decode valid (grid) and test (chosen beam, α), write the hypotheses, score them.

    Args:
        cfg: the ``evaluate`` section.
        model_dir: ``paths.model`` holding ``averaged.pt``.
        shards_dir: ``paths.shards`` (valid and test splits are decoded).
        raw_dir: ``paths.raw`` holding the untouched references ``{valid,test}.de``.
        eval_dir: ``paths.eval``; receives ``{valid,test}.hyp.de``.

    Returns:
        Per set every figure and signature, the grid, the chosen beam and α, the device.

    Raises:
        CheckpointError: unreadable model file. DataError: shards/references that disagree.
    """
    from pipeline.core import tracking

    translator = load_translator(model_file.path_in(model_dir))
    log.info("evaluating on %s", translator.device)
    data = {}
    for split in SETS:
        sources, truncated = load_sources(shards_dir, split, translator)
        data[split] = (sources, truncated, *_references(raw_dir, split, len(sources), shards_dir))
    run = tracking.current()
    sources, truncated, ref_path, refs = data["valid"]
    grid, chosen, valid_text = choose_on_valid(cfg, translator, sources, refs)
    beam, alpha = chosen["beam"], chosen["alpha"]
    hyp_paths = {split: Path(eval_dir) / f"{split}.hyp.{TARGET_LANG}" for split in SETS}
    write_lines(hyp_paths["valid"], valid_text)
    report = {"valid": _set_report(hyp_paths["valid"], ref_path, seconds=chosen["decode_seconds"], beam=beam,
                                   alpha=alpha, truncated=truncated)}
    sources, truncated, ref_path, _ = data["test"]
    start = time.monotonic()
    hyps = decode_sources(translator, sources, beam_size=beam, alphas=[alpha], max_len_a=cfg.max_len_a,
                          max_len_b=cfg.max_len_b, max_tokens=cfg.max_tokens, label="test")[alpha]
    seconds = time.monotonic() - start
    write_lines(hyp_paths["test"], detokenize(translator, hyps))
    report["test"] = _set_report(hyp_paths["test"], ref_path, seconds=seconds, beam=beam, alpha=alpha,
                                 truncated=truncated)
    report.update(grid=grid, chosen={"beam": beam, "alpha": alpha, "chosen_on": "valid"},
                  device=str(translator.device))
    run.log_metrics({f"{split}.{key}": report[split][key] for split in SETS
                     for key in (*METRIC_KEYS, "sentences_per_second", "decode_seconds")})
    run.log_metrics({f"grid.beam{e['beam']}.alpha{e['alpha']:g}.valid_bleu": e["bleu"] for e in grid})
    run.set_tags({"sacrebleu_signature": report["test"]["signatures"]["bleu"],
                  **{f"signature.{k}": v for k, v in report["test"]["signatures"].items()},
                  "chosen_beam": beam, "chosen_alpha": alpha})
    log.info("test BLEU %.2f (%s), valid %.2f; beam %d, alpha %g", report["test"]["bleu"],
             report["test"]["signatures"]["bleu"], report["valid"]["bleu"], beam, alpha)
    return report


def _run(params: Params, args: argparse.Namespace) -> dict:
    paths = params.paths
    return stage(params.evaluate, model_dir=paths.model, shards_dir=paths.shards, raw_dir=paths.raw,
                 eval_dir=paths.eval)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.evaluate``."""
    return stage_main("evaluate", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
