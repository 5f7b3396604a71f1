"""Decoding around ``model.beam_search``: length-sorted batches of at most ``max_tokens`` padded source tokens,
under the fairseq rule one search per beam size re-ranked for every α (its finished set does not depend on α),
under the t2t rule one search per α (where it stops depends on α: ``model/beam_rules.py``)."""

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


def resolve_device(spec: str | None, option: str = "--device") -> torch.device:
    """The torch device a ``--device`` value names (None: CUDA if available), checked before any model loads."""
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, index = parse_device(spec, option)
    if kind == "cuda":
        check_cuda(spec, index, torch.cuda.device_count() if torch.cuda.is_available() else 0, option=option)
    return torch.device(kind, index) if index is not None else torch.device(kind)


def load_translator(path: str | Path, device: torch.device | str | None = None) -> Translator:
    """Load an ``averaged.pt`` into a model in eval mode on ``device`` (default: :func:`resolve_device`'s).

    Raises:
        CheckpointError: missing, truncated or corrupt file, or weights that do not fit the config.
    """
    import sentencepiece as spm

    device = torch.device(device) if device is not None else resolve_device(None)
    mf = model_file.load(path)
    model = model_file.build_model(mf, path)
    try:
        sp = spm.SentencePieceProcessor(model_proto=mf.spm)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: its BPE model cannot be read ({exc}); {model_file.REMEDY}") from None
    model.to(device).eval()
    return Translator(model, mf.config, sp, device, mf.spm)


def plan_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of non-zero ``lengths`` in batches, by (length desc, index asc), cut greedily so that
    ``len(batch) × max(length in batch) <= max_tokens`` (a longer single sentence gets a batch of its own)."""
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
    """[len(rows), longest] int64, right-padded."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def plan_searches(translator: Translator, sources: Sequence[Sequence[int]], *, beam_size: int, max_len_a: float,
                  max_len_b: float, max_tokens: int) -> list[Job]:
    """The :data:`Job` list :func:`decode_sources` runs; long sentences search apart, limited to ``max_positions``."""
    cfg = translator.config
    lengths = [len(s) for s in sources]
    capped = [max_length(n, max_len_a, max_len_b) > cfg.max_positions for n in lengths]
    plain = plan_batches([0 if c else n for n, c in zip(lengths, capped)], max_tokens)
    long = plan_batches([n if c else 0 for n, c in zip(lengths, capped)], max_tokens)
    return [(batch, [list(sources[i]) for i in batch], beam_size, a, b)
            for batches, a, b in ((plain, max_len_a, max_len_b), (long, 0.0, cfg.max_positions)) for batch in batches]


def decode_sources(
    translator: Translator, sources: Sequence[Sequence[int]], *, beam_size: int, alphas: Sequence[float],
    max_len_a: float, max_len_b: float, max_tokens: int, label: str = "decode", rule: str = "fairseq",
) -> dict[float, list[list[int]]]:
    """``{alpha: hypotheses}`` of every model source (ids + EOS, ``[]``: empty) by beam ``rule``, searched once
    and re-ranked per α (``fairseq``) or once per α (``t2t``): per sentence in input order, the ids without
    BOS/EOS; logs progress (``label``) every 10 s."""
    out = {float(a): [[] for _ in sources] for a in alphas}
    jobs = plan_searches(translator, sources, beam_size=beam_size, max_len_a=max_len_a, max_len_b=max_len_b,
                         max_tokens=max_tokens)
    dev, total, done, start, last = translator.device, sum(len(job[0]) for job in jobs), 0, time.monotonic(), 0.0
    searches = [list(out)] if rule == "fairseq" else [[alpha] for alpha in out]  # the α each search serves
    for batch, rows, k, a, b in jobs:
        src = _pad(rows, translator.config.pad_id, dev)
        for alphas in searches:
            with torch.inference_mode(), autocast(dev):
                finished = beam_search(translator.model, src, beam_size=k, alpha=alphas[0], max_len_a=a,
                                       max_len_b=b, return_finished=True, rule=rule)
            for i, hyps in zip(batch, finished):
                for alpha in alphas:
                    out[alpha][i] = best_hypothesis(hyps, alpha)
        done, now = done + len(batch), time.monotonic() - start
        if now - last >= 10.0 or done == total:
            last, rate = now, done / max(now, 1e-9)
            log.info("%s beam %d: %d/%d sentences, %.1f sent/s, ETA %.0f s", label, beam_size, done, total, rate,
                     (total - done) / max(rate, 1e-9))
    return out
