"""The evaluate stage's work: its inputs checked, the (beam, α) grid on valid, scored decodes.

One decode per beam size, every α re-ranked from its finished set, valid BLEU (13a cased) for the whole grid
(:func:`choose_on_valid`). Hypotheses are detokenised with the model's own SentencePiece model and scored
against the untouched ``<paths.raw>/{valid,test}.de`` (never cleaned or BPE-decoded text) with sacreBLEU's
five figures and the paper's tokenized, compound-split BLEU (:mod:`pipeline.inference.scoring`). Every line
is kept: an empty source gives an empty hypothesis line.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch

from pipeline.artifacts import checkpoint, model_file
from pipeline.core.config import EvaluateConfig
from pipeline.core.errors import CheckpointError, DataError
from pipeline.core.textio import read_lines, write_lines
from pipeline.data.shards import ShardSet
from pipeline.inference.common import detokenize, prepare_source
from pipeline.inference.decoding import Translator, decode_sources
from pipeline.inference.perplexity import perplexity
from pipeline.inference.scoring import primary_bleu, score_files

log = logging.getLogger(__name__)

TARGET_LANG = "de"


@dataclass(frozen=True)
class EvalSet:
    """One split as a model decodes it: its sources (model ids, line order) and its raw references."""

    sources: list[list[int]]
    truncated: int
    """Sources cut to the model's ``max_positions``."""
    ref_path: Path
    refs: list[str]


def load_set(shards_dir: str | Path, raw_dir: str | Path, split: str, translator: Translator) -> EvalSet:
    """A split's model sources for ``translator`` (line order) and its references ``<raw_dir>/<split>.de``.

    Raises:
        DataError: shards from another BPE model, a split that lost lines (ids not 0..n-1), or a reference
            file missing or of another line count.
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
    ref_path = Path(raw_dir) / f"{split}.{TARGET_LANG}"
    if not ref_path.is_file():
        raise DataError(f"{ref_path}: reference missing; run `dvc repro download`")
    refs = list(read_lines(ref_path))
    if len(refs) != len(sources):
        raise DataError(f"{ref_path} has {len(refs)} lines but the {split} shards in {shards_dir} hold "
                        f"{len(sources)} sentences: the set must keep all its lines; rerun `dvc repro clean encode`")
    return EvalSet(sources, truncated, ref_path, refs)


class GridEntry(TypedDict):
    """One (beam, α) of the grid on valid: its BLEU and the seconds of its beam size's decode."""

    beam: int
    alpha: float
    bleu: float
    decode_seconds: float


def choose_on_valid(cfg: EvaluateConfig, translator: Translator, sources: list[list[int]],
                    refs: list[str]) -> tuple[list[GridEntry], GridEntry, list[str]]:
    """Decode valid once per beam size, rank every α; returns (grid, chosen entry, chosen hypotheses).

    The chosen entry has the highest valid BLEU; ties go to the earlier grid entry (beam sizes and
    α in params order).
    """
    grid: list[GridEntry] = []
    best: tuple[float, GridEntry, list[str]] | None = None
    for beam in cfg.beam_sizes:
        start = time.monotonic()
        by_alpha = decode_sources(translator, sources, beam_size=beam, alphas=cfg.alphas, max_len_a=cfg.max_len_a,
                                  max_len_b=cfg.max_len_b, max_tokens=cfg.max_tokens, label="valid")
        seconds = time.monotonic() - start
        for alpha in cfg.alphas:
            text = detokenize(translator.sp, by_alpha[float(alpha)])
            entry = GridEntry(beam=beam, alpha=float(alpha), bleu=primary_bleu(text, refs),
                              decode_seconds=round(seconds, 3))
            grid.append(entry)
            log.info("valid beam %d alpha %.2f: BLEU %.2f", beam, alpha, entry["bleu"])
            if best is None or entry["bleu"] > best[0]:
                best = (entry["bleu"], entry, text)
    assert best is not None  # cfg guarantees a non-empty grid
    return grid, best[1], best[2]


def _set_report(hyp_path: Path, data: EvalSet, *, seconds: float, beam: int, alpha: float) -> dict[str, Any]:
    """Every figure of ``hyp_path`` against the references, and how it was decoded."""
    report = score_files(hyp_path, data.ref_path, TARGET_LANG)
    n = report["sentences"]
    report.update(decode_seconds=round(seconds, 3), sentences_per_second=round(n / max(seconds, 1e-9), 2),
                  beam=beam, alpha=alpha, truncated_sources=data.truncated, hypotheses=str(hyp_path),
                  reference=str(data.ref_path))
    return report


def decode_and_score(cfg: EvaluateConfig, translator: Translator, data: EvalSet, hyp_path: Path, *, beam: int,
                     alpha: float, label: str) -> dict[str, Any]:
    """Decode ``data`` once at (``beam``, ``alpha``), write the hypotheses to ``hyp_path`` and score them."""
    start = time.monotonic()
    hyps = decode_sources(translator, data.sources, beam_size=beam, alphas=[alpha], max_len_a=cfg.max_len_a,
                          max_len_b=cfg.max_len_b, max_tokens=cfg.max_tokens, label=label)[alpha]
    seconds = time.monotonic() - start
    write_lines(hyp_path, detokenize(translator.sp, hyps))
    return _set_report(hyp_path, data, seconds=seconds, beam=beam, alpha=alpha)


def evaluate_averaged(cfg: EvaluateConfig, translator: Translator, valid: EvalSet, test: EvalSet,
                      hyp_paths: dict[str, Path]) -> dict[str, Any]:
    """The grid on valid, test at the chosen (beam, α); writes ``hyp_paths["valid"]`` and ``["test"]``; returns
    ``valid`` and ``test`` (every figure and signature), ``grid``, ``chosen`` and ``device``."""
    grid, chosen, valid_text = choose_on_valid(cfg, translator, valid.sources, valid.refs)
    beam, alpha = chosen["beam"], chosen["alpha"]
    write_lines(hyp_paths["valid"], valid_text)
    return {"valid": _set_report(hyp_paths["valid"], valid, seconds=chosen["decode_seconds"], beam=beam,
                                 alpha=alpha),
            "test": decode_and_score(cfg, translator, test, hyp_paths["test"], beam=beam, alpha=alpha,
                                     label="test"),
            "grid": grid, "chosen": {"beam": beam, "alpha": alpha, "chosen_on": "valid"},
            "device": str(translator.device)}


def perplexity_fields(model: torch.nn.Module, shards: ShardSet, max_tokens: int) -> dict[str, float]:
    """``nll``, ``ppl`` and what they were computed on, as the report stores them."""
    figures = perplexity(model, shards, max_tokens=max_tokens)
    return {"nll": figures["nll"], "ppl": figures["ppl"], "ppl_tokens": figures["tokens"],
            "ppl_skipped": figures["skipped"]}


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
    """A training checkpoint folder (``step-NNNNNNNN`` with ``DONE``) and the run's BPE model (``spm_model``) as a
    :class:`Translator` in eval mode on ``device``, built as ``averaged.pt``'s model is
    (:func:`pipeline.artifacts.model_file.checkpoint_config`, :func:`pipeline.artifacts.model_file.build_model`).

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
    mf = model_file.ModelFile(weights=checkpoint.load_state_dict(folder), config=config, spm=spm_bytes)
    model = model_file.build_model(mf, folder / checkpoint.MODEL, remedy=f"was it trained with {spm_path}? If "
                                   "not, point paths.bpe at the run's BPE model or retrain (`dvc repro train`)")
    device = torch.device(device)
    model.to(device).eval()
    return Translator(model, config, sp, device, spm_bytes)
