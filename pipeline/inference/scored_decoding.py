"""The evaluate stage's work: its inputs checked, the (beam, α) grid on valid, scored decodes and perplexity,
every hypothesis scored against the untouched ``<paths.raw>/{valid,test}.de`` (:mod:`pipeline.inference.scoring`)."""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from model import Transformer, autocast, label_smoothed_nll_loss
from pipeline.artifacts import checkpoint, model_file
from pipeline.core.config import EvaluateConfig
from pipeline.core.details import Chosen, EvaluateDetails, GridPoint, Machine, SetFigures
from pipeline.core.errors import CheckpointError, DataError
from pipeline.core.owned import write_lines
from pipeline.core.textio import read_lines
from pipeline.data import batching
from pipeline.data.shard_reader import ShardSet
from pipeline.inference.common import detokenize, prepare_source
from pipeline.inference.decoding import Translator, decode_sources
from pipeline.inference.scoring import primary_bleu, score_files

log = logging.getLogger(__name__)

TARGET_LANG = "de"


@dataclass(frozen=True)
class EvalSet:
    """One split as a model decodes it: its sources (model ids, line order) and its raw references."""

    sources: list[list[int]]
    truncated: int  # sources cut to the model's max_positions
    ref_path: Path
    refs: list[str]


def load_set(shards_dir: str | Path, raw_dir: str | Path, split: str, translator: Translator) -> EvalSet:
    """A split's model sources for ``translator`` (line order) and its references ``<raw_dir>/<split>.de``.

    Raises:
        DataError: shards from another BPE model, a split that lost lines, a reference missing or of another length.
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


def choose_on_valid(cfg: EvaluateConfig, translator: Translator, sources: list[list[int]],
                    refs: list[str]) -> tuple[list[GridPoint], GridPoint, list[str]]:
    """Decode valid per beam size (fairseq rule: once, ranked for every α; t2t: once per α), every α scored:
    (grid, best valid BLEU entry (earliest on ties), its hyps)."""
    grid: list[GridPoint] = []
    best: tuple[float, GridPoint, list[str]] | None = None
    for beam in cfg.beam_sizes:
        start = time.monotonic()
        by_alpha = decode_sources(translator, sources, beam_size=beam, alphas=cfg.alphas, max_len_a=cfg.max_len_a,
                                  max_len_b=cfg.max_len_b, max_tokens=cfg.max_tokens, label="valid",
                                  rule=cfg.beam_rule)
        seconds = time.monotonic() - start
        for alpha in cfg.alphas:
            text = detokenize(translator.sp, by_alpha[float(alpha)])
            entry = GridPoint(beam=beam, alpha=float(alpha), bleu=primary_bleu(text, refs),
                              decode_seconds=round(seconds, 3))
            grid.append(entry)
            log.info("valid beam %d alpha %.2f: BLEU %.2f", beam, alpha, entry.bleu)
            if best is None or entry.bleu > best[0]:
                best = (entry.bleu, entry, text)
    assert best is not None  # cfg guarantees a non-empty grid
    return grid, best[1], best[2]


def _set_report(hyp_path: Path, data: EvalSet, *, seconds: float, beam: int, alpha: float) -> SetFigures:
    """Every figure of ``hyp_path`` against the references, and how it was decoded."""
    scores = score_files(hyp_path, data.ref_path, TARGET_LANG)
    n = scores.sentences or 0
    return scores.replace(decode_seconds=round(seconds, 3), sentences_per_second=round(n / max(seconds, 1e-9), 2),
                          beam=beam, alpha=alpha, truncated_sources=data.truncated, hypotheses=str(hyp_path),
                          reference=str(data.ref_path))


def decode_and_score(cfg: EvaluateConfig, translator: Translator, data: EvalSet, hyp_path: Path, *, beam: int,
                     alpha: float, label: str) -> SetFigures:
    """Decode ``data`` once at (``beam``, ``alpha``), write the hypotheses to ``hyp_path`` and score them."""
    start = time.monotonic()
    hyps = decode_sources(translator, data.sources, beam_size=beam, alphas=[alpha], max_len_a=cfg.max_len_a,
                          max_len_b=cfg.max_len_b, max_tokens=cfg.max_tokens, label=label, rule=cfg.beam_rule)[alpha]
    seconds = time.monotonic() - start
    write_lines(hyp_path, detokenize(translator.sp, hyps))
    return _set_report(hyp_path, data, seconds=seconds, beam=beam, alpha=alpha)


def evaluate_averaged(cfg: EvaluateConfig, translator: Translator, valid: EvalSet, test: EvalSet,
                      hyp_paths: dict[str, Path]) -> EvaluateDetails:
    """The grid on valid, test at the chosen (beam, α), hypotheses written to ``hyp_paths``; returns all figures
    (``valid_newest`` not yet)."""
    grid, chosen, valid_text = choose_on_valid(cfg, translator, valid.sources, valid.refs)
    beam, alpha = chosen.beam, chosen.alpha
    write_lines(hyp_paths["valid"], valid_text)
    return EvaluateDetails(
        valid=_set_report(hyp_paths["valid"], valid, seconds=chosen.decode_seconds, beam=beam, alpha=alpha),
        test=decode_and_score(cfg, translator, test, hyp_paths["test"], beam=beam, alpha=alpha, label="test"),
        grid=grid, chosen=Chosen(beam=beam, alpha=alpha, chosen_on="valid"), device=str(translator.device),
        machine=Machine.here())


@torch.no_grad()
def perplexity(model: Transformer, shards: ShardSet, *, max_tokens: int) -> dict[str, float]:
    """Per-token NLL and perplexity of ``model`` on every pair of ``shards`` that fits the model.

    The paper's Table 3 "per-wordpiece" perplexity: every non-pad target token (pieces and EOS), ``ppl = exp(sum /
    tokens)``; batches as training's validation plans them, eval mode (restored after), :func:`model.autocast`.

    Returns:
        ``{"nll" (nats per token), "ppl", "tokens", "sentences", "skipped"}``; none scored is a DataError.
    """
    cfg = model.cfg
    device = next(model.parameters()).device
    ids, src_len, tgt_len = shards.lengths()
    plan = batching.valid_plan(ids, batching.token_lengths(src_len, tgt_len), max_tokens=max_tokens,
                               max_positions=cfg.max_positions)
    sentences = sum(len(b) for b in plan)
    was_training = model.training
    model.eval()
    nll_sum, tokens = 0.0, 0
    try:
        for batch_ids in plan:
            batch = batching.collate(shards.fetch(batch_ids), pad_id=cfg.pad_id, bos_id=cfg.bos_id,
                                     eos_id=cfg.eos_id).to(device)
            with autocast(device):
                logits = model(batch.src, batch.tgt_in)  # [B, T, V]
            _, nll = label_smoothed_nll_loss(logits, batch.tgt_out, epsilon=0.0, ignore_index=cfg.pad_id)
            nll_sum += float(nll)
            tokens += batch.n_tokens
    finally:
        model.train(was_training)
    if tokens == 0:
        raise DataError(f"{shards.root}: split {shards.split!r} has no pair that fits model.max_positions "
                        f"({cfg.max_positions}); nothing to compute a perplexity on: check `dvc repro encode`")
    nll = nll_sum / tokens
    log.info("%s perplexity %.3f (NLL %.4f over %d tokens, %d sentences, %d skipped)", shards.split,
             math.exp(nll), nll, tokens, sentences, len(ids) - sentences)
    return {"nll": nll, "ppl": math.exp(nll), "tokens": tokens, "sentences": sentences,
            "skipped": int(len(ids) - sentences)}


def with_perplexity(figures: SetFigures, model: Transformer, shards: ShardSet, max_tokens: int) -> SetFigures:
    """``figures`` with ``model``'s ``nll`` and ``ppl`` on ``shards`` and what they were computed on."""
    found = perplexity(model, shards, max_tokens=max_tokens)
    return figures.replace(nll=found["nll"], ppl=found["ppl"], ppl_tokens=int(found["tokens"]),
                           ppl_skipped=int(found["skipped"]))


def newest_checkpoint(train_dir: str | Path) -> tuple[int, Path]:
    """``(step, folder)`` of the newest complete checkpoint in ``train_dir``; none is a CheckpointError."""
    done = checkpoint.complete_checkpoints(train_dir)
    if not done:
        raise CheckpointError(f"{train_dir}: no complete training checkpoint (step-NNNNNNNN/ with DONE) to score "
                              "beside the averaged model; run `dvc repro train`")
    return done[-1]


def checkpoint_translator(folder: Path, spm_model: str | Path) -> Translator:
    """A training checkpoint folder and the run's BPE model as a :class:`Translator` in eval mode on the CPU.

    Raises:
        CheckpointError: an incomplete or unreadable checkpoint, or one that does not fit the BPE model.
        DataError: ``spm_model`` missing or not a SentencePiece model.
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
    return Translator(model.eval(), config, sp, torch.device("cpu"), spm_bytes)
