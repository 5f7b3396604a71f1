"""Stage ``evaluate``: decode valid and test with the averaged model and score against the raw references.

Beam size and α are chosen on the valid set only: one decode per beam size, every α re-ranked
from its finished set, valid BLEU (13a cased) reported for the whole grid; the test set is then
decoded once with the chosen (beam, α). Hypotheses are detokenised with the model's own
SentencePiece model and scored against the untouched ``<paths.raw>/{valid,test}.de`` (never
cleaned or BPE-decoded text) with sacreBLEU's five figures and the paper's tokenized,
compound-split BLEU (:mod:`pipeline.inference.scoring`). Every line of both sets is kept: an empty source
gives an empty hypothesis line.

Beside the averaged model, the newest complete training checkpoint of ``paths.train`` (no averaging)
decodes valid once at the chosen (beam, α) into ``valid.newest.hyp.de``, and both models get the
valid set's teacher-forced per-token perplexity (:mod:`pipeline.inference.perplexity`): the paper's
Table 3 reports newstest2013 BLEU and perplexity of single models without checkpoint averaging, so
the audit compares ``valid_newest`` with it, and a newest checkpoint that beats the average is logged
as a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.artifacts import checkpoint, model_file
from pipeline.core.config import EvaluateConfig, Params
from pipeline.core.errors import CheckpointError, DataError
from pipeline.core.stage import stage_main
from pipeline.core.textio import atomic_path, read_lines, refuse_foreign, write_lines
from pipeline.data.shards import ShardSet
from pipeline.inference.common import detokenize, prepare_source
from pipeline.inference.decoding import Translator, decode_sources, load_translator
from pipeline.inference.perplexity import perplexity
from pipeline.inference.scoring import METRIC_KEYS, primary_bleu, score_files

log = logging.getLogger(__name__)

SETS = ("valid", "test")
TARGET_LANG = "de"
NEWEST_HYP = f"valid.newest.hyp.{TARGET_LANG}"


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
            text = detokenize(translator.sp, by_alpha[float(alpha)])
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


def newest_checkpoint(train_dir: str | Path) -> tuple[int, Path]:
    """``(step, folder)`` of the complete checkpoint with the highest step in ``train_dir``.

    Raises:
        CheckpointError: the folder is missing or holds no complete checkpoint (one line, with the remedy).
    """
    done = checkpoint.complete_checkpoints(train_dir)
    if not done:
        raise CheckpointError(f"{train_dir}: no complete training checkpoint (step-NNNNNNNN/ with DONE) to score "
                              "beside the averaged model; run `dvc repro train`")
    return done[-1]


def checkpoint_translator(folder: Path, spm_model: str | Path, device: torch.device | str = "cpu") -> Translator:
    """A training checkpoint folder and the run's BPE model as a :class:`Translator` in eval mode.

    The model is built as the average stage builds ``averaged.pt``'s: the config from ``state.json``'s
    ``config.model`` with ``spm.model``'s vocabulary (:func:`pipeline.artifacts.model_file.checkpoint_config`),
    the weights from ``model.pt`` (:func:`pipeline.artifacts.checkpoint.load_state_dict`), fitted by
    :func:`pipeline.artifacts.model_file.build_model`.

    Args:
        folder: ``<paths.train>/step-NNNNNNNN`` with ``DONE``.
        spm_model: ``<paths.bpe>/spm.model``.
        device: where the model goes.

    Raises:
        CheckpointError: incomplete folder, unreadable ``state.json``/``model.pt``, or weights, config and
            vocabulary that do not fit. DataError: ``spm_model`` missing or not a SentencePiece model.
    """
    import sentencepiece as spm

    spm_path = Path(spm_model)
    try:
        spm_bytes = spm_path.read_bytes()
        sp = spm.SentencePieceProcessor(model_proto=spm_bytes)
    except FileNotFoundError:
        raise DataError(f"{spm_path}: not found; run `dvc repro bpe`") from None
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DataError(f"{spm_path}: not a SentencePiece model ({exc}); rerun `dvc repro bpe`") from None
    config = model_file.checkpoint_config(folder, sp.get_piece_size())
    weights_path = folder / checkpoint.MODEL
    mf = model_file.ModelFile(weights=checkpoint.load_state_dict(folder), config=config, spm=spm_bytes)
    model = model_file.build_model(mf, weights_path, remedy=f"was it trained with {spm_path}? If not, point "
                                   "paths.bpe at the run's BPE model or retrain (`dvc repro train`)")
    device = torch.device(device)
    model.to(device).eval()
    return Translator(model, config, sp, device, spm_bytes)


def _perplexity_fields(model: torch.nn.Module, shards: ShardSet, max_tokens: int) -> dict[str, Any]:
    """``nll``, ``ppl`` and what they were computed on, as the report stores them."""
    figures = perplexity(model, shards, max_tokens=max_tokens)
    return {"nll": figures["nll"], "ppl": figures["ppl"], "ppl_tokens": figures["tokens"],
            "ppl_skipped": figures["skipped"]}


def _evaluate_averaged(cfg: EvaluateConfig, translator: Translator, data: dict[str, tuple],
                       hyp_paths: dict[str, Path]) -> dict[str, Any]:
    """Grid on valid, test at the chosen (beam, α); writes both hypothesis files."""
    sources, truncated, ref_path, refs = data["valid"]
    grid, chosen, valid_text = choose_on_valid(cfg, translator, sources, refs)
    beam, alpha = chosen["beam"], chosen["alpha"]
    write_lines(hyp_paths["valid"], valid_text)
    report = {"valid": _set_report(hyp_paths["valid"], ref_path, seconds=chosen["decode_seconds"], beam=beam,
                                   alpha=alpha, truncated=truncated)}
    sources, truncated, ref_path, _ = data["test"]
    start = time.monotonic()
    hyps = decode_sources(translator, sources, beam_size=beam, alphas=[alpha], max_len_a=cfg.max_len_a,
                          max_len_b=cfg.max_len_b, max_tokens=cfg.max_tokens, label="test")[alpha]
    seconds = time.monotonic() - start
    write_lines(hyp_paths["test"], detokenize(translator.sp, hyps))
    report["test"] = _set_report(hyp_paths["test"], ref_path, seconds=seconds, beam=beam, alpha=alpha,
                                 truncated=truncated)
    report.update(grid=grid, chosen={"beam": beam, "alpha": alpha, "chosen_on": "valid"},
                  device=str(translator.device))
    return report


def _evaluate_newest(cfg: EvaluateConfig, translator: Translator, prepared: tuple[list[list[int]], int],
                     ref_path: Path, hyp_path: Path, *, beam: int, alpha: float) -> dict[str, Any]:
    """Decode valid once at the chosen (beam, α), write ``hyp_path`` and score it.

    ``prepared`` is :func:`load_sources`' ``(sources, truncated)`` for ``translator``.
    """
    sources, truncated = prepared
    start = time.monotonic()
    hyps = decode_sources(translator, sources, beam_size=beam, alphas=[alpha], max_len_a=cfg.max_len_a,
                          max_len_b=cfg.max_len_b, max_tokens=cfg.max_tokens, label="valid newest")[alpha]
    seconds = time.monotonic() - start
    write_lines(hyp_path, detokenize(translator.sp, hyps))
    return _set_report(hyp_path, ref_path, seconds=seconds, beam=beam, alpha=alpha, truncated=truncated)


def _log_run(report: dict[str, Any]) -> None:
    """Metrics and tags of the stage's MLflow run; the averaging warning."""
    from pipeline.core import tracking

    run = tracking.current()
    newest, beam, alpha = report["valid_newest"], report["chosen"]["beam"], report["chosen"]["alpha"]
    run.log_metrics({f"{split}.{key}": report[split][key] for split in SETS
                     for key in (*METRIC_KEYS, "sentences_per_second", "decode_seconds")})
    run.log_metrics({f"grid.beam{e['beam']}.alpha{e['alpha']:g}.valid_bleu": e["bleu"] for e in report["grid"]})
    run.log_metrics({"valid.ppl": report["valid"]["ppl"], "valid_newest.bleu": newest["bleu"],
                     "valid_newest.ppl": newest["ppl"]})
    run.set_tags({"sacrebleu_signature": report["test"]["signatures"]["bleu"],
                  **{f"signature.{k}": v for k, v in report["test"]["signatures"].items()},
                  "chosen_beam": beam, "chosen_alpha": alpha})
    log.info("test BLEU %.2f (%s), valid %.2f (ppl %.2f); beam %d, alpha %g", report["test"]["bleu"],
             report["test"]["signatures"]["bleu"], report["valid"]["bleu"], report["valid"]["ppl"], beam, alpha)
    log.info("newest checkpoint %s (step %d): valid BLEU %.2f, ppl %.2f", newest["checkpoint"], newest["step"],
             newest["bleu"], newest["ppl"])
    if newest["bleu"] > report["valid"]["bleu"]:
        log.warning("averaging hurt: the newest checkpoint %s scores valid BLEU %.2f, the averaged model %.2f "
                    "(beam %d, alpha %g)", newest["checkpoint"], newest["bleu"], report["valid"]["bleu"], beam, alpha)


def stage(cfg: EvaluateConfig, *, model_dir: str | Path, shards_dir: str | Path, raw_dir: str | Path,
          eval_dir: str | Path, train_dir: str | Path, spm_model: str | Path) -> dict:
    """Decode valid (grid) and test (chosen beam, α) with the averaged model, valid with the newest checkpoint.

    Every input is read and checked before the first decode. Both models also get the valid set's
    teacher-forced per-token perplexity (:mod:`pipeline.inference.perplexity`).

    Args:
        cfg: the ``evaluate`` section.
        model_dir: ``paths.model`` holding ``averaged.pt``.
        shards_dir: ``paths.shards`` (valid and test splits are decoded).
        raw_dir: ``paths.raw`` holding the untouched references ``{valid,test}.de``.
        eval_dir: ``paths.eval``; written whole (``{valid,test}.hyp.de``, ``valid.newest.hyp.de``), replacing
            only a folder this stage wrote.
        train_dir: ``paths.train``; its newest complete checkpoint is scored on valid.
        spm_model: ``<paths.bpe>/spm.model``, the BPE model the checkpoints were trained with.

    Returns:
        Per set every figure and signature (valid also ``nll``/``ppl``), the grid, the chosen beam and α,
        the device, and ``valid_newest``: the newest checkpoint's step, folder, valid figures and perplexity.

    Raises:
        CheckpointError: unreadable model file or checkpoint, no checkpoint in ``train_dir``.
        DataError: shards/references/BPE model that disagree.
    """
    refuse_foreign(Path(eval_dir), "eval")  # before the work, not only at the swap
    translator = load_translator(model_file.path_in(model_dir))
    log.info("evaluating on %s", translator.device)
    data = {}
    for split in SETS:
        sources, truncated = load_sources(shards_dir, split, translator)
        data[split] = (sources, truncated, *_references(raw_dir, split, len(sources), shards_dir))
    step, folder = newest_checkpoint(train_dir)
    newest = checkpoint_translator(folder, spm_model)  # on CPU until the averaged model is done
    newest_sources = load_sources(shards_dir, "valid", newest)
    valid_shards = ShardSet(shards_dir, "valid")
    with atomic_path(eval_dir, role="eval") as out:  # the folder whole: replaced only if this stage wrote it
        out.mkdir()
        report = _evaluate_averaged(cfg, translator, data, {split: out / f"{split}.hyp.{TARGET_LANG}"
                                                            for split in SETS})
        report["valid"].update(_perplexity_fields(translator.model, valid_shards, cfg.max_tokens))
        translator.model.to("cpu")  # one model on the accelerator at a time
        newest.model.to(translator.device)
        newest = dataclasses.replace(newest, device=translator.device)
        figures = _evaluate_newest(cfg, newest, newest_sources, data["valid"][2], out / NEWEST_HYP,
                                   beam=report["chosen"]["beam"], alpha=report["chosen"]["alpha"])
    for entry in (report["valid"], report["test"], figures):  # name the files where they now are
        if "hypotheses" in entry:
            entry["hypotheses"] = str(Path(eval_dir) / Path(entry["hypotheses"]).name)
    report["valid_newest"] = {"step": step, "checkpoint": str(folder), **figures,
                              **_perplexity_fields(newest.model, valid_shards, cfg.max_tokens)}
    _log_run(report)
    return report


def _run(params: Params, args: argparse.Namespace) -> dict:
    paths = params.paths
    return stage(params.evaluate, model_dir=paths.model, shards_dir=paths.shards, raw_dir=paths.raw,
                 eval_dir=paths.eval, train_dir=paths.train, spm_model=Path(paths.bpe) / "spm.model")


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.evaluate``."""
    return stage_main("evaluate", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
