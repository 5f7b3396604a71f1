"""Decoding around ``model.beam_search``: the model file, length-sorted batches, α re-ranking.

Shared by the ``evaluate`` stage and ``nmt translate``. Sentences are sorted by source length and
cut into batches whose padded source size (sentences × longest source, EOS included) stays within
``max_tokens`` on every device; results go back to the input order. One beam search per beam size serves
every α: the finished set does not depend on α (the rule in ``model/beam.py``), so each α only re-ranks it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model import Transformer, TransformerConfig, autocast, beam_search, best_hypothesis
from model.config import max_length
from pipeline.artifacts import model_file
from pipeline.core.errors import CheckpointError
from pipeline.inference.common import check_cuda, parse_device

log = logging.getLogger(__name__)

#: (sentence indices, their source rows, beam size, max_len_a, max_len_b): one search.
Job = tuple[list[int], list[list[int]], int, float, float]


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


def resolve_device(spec: str | None, option: str = "--device") -> torch.device:
    """The torch device a ``--device`` value names (default: :func:`default_device`), checked against this
    machine before any model is loaded.

    Raises:
        PipelineError: a malformed value, or a CUDA device torch cannot see (one line naming ``option``).
    """
    if spec is None:
        return default_device()
    kind, index = parse_device(spec, option)
    if kind == "cuda":
        check_cuda(spec, index, torch.cuda.device_count() if torch.cuda.is_available() else 0, option=option)
    return torch.device(kind, index) if index is not None else torch.device(kind)


def load_translator(path: str | Path, device: torch.device | str | None = None) -> Translator:
    """Load an ``averaged.pt`` (:mod:`pipeline.artifacts.model_file`) into a model in eval mode.

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


def plan_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of similar length, longest first.

    Sentences are ordered by (length descending, index ascending) and cut greedily so that
    ``len(batch) × max(length in batch) <= max_tokens``; a single sentence longer than the budget gets a batch
    of its own. Zero-length entries are left out (nothing to decode).
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        if last is not None and (len(last) + 1) * lengths[last[0]] <= max_tokens:
            last.append(i)
        else:
            batches.append([i])
    return batches


def _pad(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def plan_searches(translator: Translator, sources: Sequence[Sequence[int]], *, beam_size: int, max_len_a: float,
                  max_len_b: float, max_tokens: int) -> list[Job]:
    """The searches :func:`decode_sources` runs for these arguments, in the order it starts them.

    Empty sources get none; sentences whose length limit floor(a·S + b) would pass the position table search
    apart, with the limit ``max_positions``.

    Returns:
        One :data:`Job` per search: (sentence indices, their sources, beam size, max_len_a, max_len_b).
    """
    cfg = translator.config
    lengths = [len(s) for s in sources]
    capped = [max_length(n, max_len_a, max_len_b) > cfg.max_positions for n in lengths]
    plain = plan_batches([0 if c else n for n, c in zip(lengths, capped)], max_tokens)
    long = plan_batches([n if c else 0 for n, c in zip(lengths, capped)], max_tokens)
    return [(batch, [list(sources[i]) for i in batch], beam_size, a, b)
            for batches, a, b in ((plain, max_len_a, max_len_b), (long, 0.0, cfg.max_positions)) for batch in batches]


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
    out = {float(a): [[] for _ in sources] for a in alphas}
    jobs = plan_searches(translator, sources, beam_size=beam_size, max_len_a=max_len_a, max_len_b=max_len_b,
                         max_tokens=max_tokens)
    progress = _Progress(label, beam_size, sum(len(job[0]) for job in jobs))
    for batch, finished in (_search(translator, job) for job in jobs):
        for i, hyps in zip(batch, finished):
            for alpha in out:
                out[alpha][i] = best_hypothesis(hyps, alpha)
        progress.add(len(batch))
    return out


def _search(translator: Translator, job: Job) -> tuple[list[int], list]:
    """One beam search over the sentences of ``job``: (their indices, their finished hypotheses)."""
    batch, rows, beam_size, a, b = job
    dev = translator.device
    src = _pad(rows, translator.config.pad_id, dev)
    with torch.inference_mode(), autocast(dev):
        return batch, beam_search(translator.model, src, beam_size=beam_size, max_len_a=a, max_len_b=b,
                                  return_finished=True)


class _Progress:
    """A progress line every 10 s and at the end: sentences done, rate, ETA."""

    def __init__(self, label: str, beam_size: int, total: int) -> None:
        self.label, self.beam_size, self.total = label, beam_size, total
        self.done, self.start, self.last = 0, time.monotonic(), 0.0

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic() - self.start
        if now - self.last >= 10.0 or self.done == self.total:
            self.last = now
            rate = self.done / max(now, 1e-9)
            log.info("%s beam %d: %d/%d sentences, %.1f sent/s, ETA %.0f s", self.label, self.beam_size, self.done,
                     self.total, rate, (self.total - self.done) / max(rate, 1e-9))
