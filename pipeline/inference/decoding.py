"""Decoding around ``model.beam_search``: the model file, length-sorted batches, α re-ranking, detokenising.

Shared by the ``evaluate`` stage and ``nmt translate``. Sentences are sorted by source length and
cut into batches whose padded source size (sentences × longest source, EOS included) stays within
``max_tokens``; results go back to the input order. One beam search per beam size serves every α:
the finished set does not depend on α (the rule in ``model/beam.py``), so each α only re-ranks it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model import Transformer, TransformerConfig, autocast, beam_search, best_hypothesis, max_length
from pipeline.core.errors import CheckpointError
from pipeline.inference import model_file

log = logging.getLogger(__name__)


@dataclass
class Translator:
    """A loaded ``averaged.pt``: the model in eval mode on ``device`` and its SentencePiece model."""

    model: Transformer
    config: TransformerConfig
    sp: Any  # sentencepiece.SentencePieceProcessor
    device: torch.device
    spm_bytes: bytes


def default_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_translator(path: str | Path, device: torch.device | str | None = None) -> Translator:
    """Load an ``averaged.pt`` (:mod:`pipeline.inference.model_file`) into a model in eval mode.

    Raises:
        CheckpointError: missing, truncated or corrupt file, or weights that do not fit the config
            (names the path and the remedy).
    """
    import sentencepiece as spm

    device = torch.device(device) if device is not None else default_device()
    mf = model_file.load(path)
    model = model_file.build_model(mf, path)
    try:
        sp = spm.SentencePieceProcessor(model_proto=mf.spm)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: its BPE model cannot be read ({exc}); {model_file.REMEDY}") from None
    model.to(device).eval()
    return Translator(model, mf.config, sp, device, mf.spm)


def prepare_source(ids: Sequence[int], config: TransformerConfig) -> tuple[list[int], bool]:
    """BPE ids → model source (ids + EOS), truncated to ``max_positions`` tokens; returns (source, truncated).

    A sentence without BPE ids gives ``[]`` (decoded as an empty translation without running the model).
    """
    ids = [int(i) for i in ids]
    if not ids:
        return [], False
    limit = config.max_positions - 1
    truncated = len(ids) > limit
    return ids[:limit] + [config.eos_id], truncated


def plan_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of similar length, longest first.

    Sentences are ordered by (length descending, index ascending) and cut greedily so that
    ``len(batch) × max(length in batch) <= max_tokens``; a single sentence longer than the budget
    gets a batch of its own. Zero-length entries are left out (nothing to decode).
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _pad(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def decode_sources(
    translator: Translator, sources: Sequence[Sequence[int]], *, beam_size: int, alphas: Sequence[float],
    max_len_a: float, max_len_b: float, max_tokens: int, label: str = "decode",
) -> dict[float, list[list[int]]]:
    """Beam-search every source once and re-rank the finished set for each α.

    Args:
        translator: from :func:`load_translator`.
        sources: model sources (ids + EOS, at most ``max_positions``), ``[]`` for an empty sentence.
        beam_size: k.
        alphas: length-penalty exponents to rank with (one decode serves them all).
        max_len_a, max_len_b: max output length = floor(a·S + b), capped at the model's ``max_positions``.
        max_tokens: batch budget in padded source tokens.
        label: name in progress lines.

    Returns:
        ``{alpha: hypotheses}``: per α, per sentence in input order, the ids without BOS/EOS.
    """
    cfg = translator.config
    out = {float(a): [[] for _ in sources] for a in alphas}
    lengths = [len(s) for s in sources]
    # Sentences whose length limit would pass the position table decode with the limit max_positions.
    capped = [max_length(n, max_len_a, max_len_b) > cfg.max_positions for n in lengths]
    groups = [(plan_batches([n if not c else 0 for n, c in zip(lengths, capped)], max_tokens), max_len_a, max_len_b),
              (plan_batches([n if c else 0 for n, c in zip(lengths, capped)], max_tokens), 0.0, cfg.max_positions)]
    total = sum(1 for n in lengths if n)
    done, start, last_log = 0, time.monotonic(), 0.0
    for batches, a, b in groups:
        for batch in batches:
            src = _pad([list(sources[i]) for i in batch], cfg.pad_id, translator.device)
            with torch.inference_mode(), autocast(translator.device):
                finished = beam_search(translator.model, src, beam_size=beam_size, max_len_a=a, max_len_b=b,
                                       return_finished=True)
            for i, hyps in zip(batch, finished):
                for alpha in out:
                    out[alpha][i] = best_hypothesis(hyps, alpha)
            done += len(batch)
            now = time.monotonic() - start
            if now - last_log >= 10.0 or done == total:
                last_log = now
                rate = done / max(now, 1e-9)
                log.info("%s beam %d: %d/%d sentences, %.1f sent/s, ETA %.0f s", label, beam_size, done, total,
                         rate, (total - done) / max(rate, 1e-9))
    return out


def detokenize(translator: Translator, hyps: Sequence[Sequence[int]]) -> list[str]:
    """SentencePiece ids → text, one line per hypothesis (``[]`` → ``""``; never a line break inside)."""
    return [translator.sp.decode([int(t) for t in h]).replace("\n", " ") if h else "" for h in hyps]
