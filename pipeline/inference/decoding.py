"""Decoding around ``model.beam_search``: the model file, length-sorted batches, α re-ranking, detokenising.

Shared by the ``evaluate`` stage and ``nmt translate``. Sentences are sorted by source length and
cut into batches whose padded source size (sentences × longest source, EOS included) stays within
``max_tokens`` (on CPU, also within :data:`CPU_SEARCH_TOKENS` and at most :func:`cpu_search_sentences`
sentences); results go back to the input order. One beam search per beam size serves every α:
the finished set does not depend on α (the rule in ``model/beam.py``), so each α only re-ranks it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model import Transformer, TransformerConfig, autocast, beam_search, best_hypothesis, max_length
from pipeline.core.errors import CheckpointError, PipelineError
from pipeline.inference import allocator, model_file
from pipeline.inference.workers import Job, SearchPool

log = logging.getLogger(__name__)


@dataclass
class Translator:
    """A loaded ``averaged.pt``: the model in eval mode on ``device`` and its SentencePiece model."""

    model: Transformer
    config: TransformerConfig
    sp: Any  # sentencepiece.SentencePieceProcessor
    device: torch.device
    spm_bytes: bytes
    _pool: SearchPool | None = field(default=None, repr=False, compare=False)

    def search_pool(self, n_workers: int, threads: int) -> SearchPool:
        """The CPU search workers of this model: forked on first use and kept for later decodes (remade when
        ``n_workers`` or ``threads`` change). :meth:`close` ends them."""
        pool = self._pool
        if pool is None or (pool.workers, pool.threads) != (n_workers, threads):
            self.close()
            pool = self._pool = SearchPool(self, _search, n_workers, threads)
        return pool

    def close(self) -> None:
        """End the search workers, if any (the model stays usable; a later decode with workers forks anew)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def default_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def parse_device(spec: str, option: str = "--device") -> tuple[str, int | None]:
    """``cpu``, ``cuda`` or ``cuda:N`` → (type, index or None), checked before anything is loaded.

    Raises:
        PipelineError: any other string, naming ``option`` and what it accepts.
    """
    match = _DEVICE.fullmatch(spec.strip())
    if match is None or (match[1] == "cpu" and match[2] is not None):
        raise PipelineError(f"{option} {spec}: not a device; use cpu, cuda or cuda:N (N = 0 for the first GPU)")
    return match[1], None if match[2] is None else int(match[2])


def check_cuda(spec: str, index: int | None, count: int, *, option: str = "--device", library: str = "torch",
               probe: str = "torch.cuda.is_available() is False") -> None:
    """Refuse a CUDA device this machine does not have (``count`` devices that ``library`` sees, ``probe`` the
    call that said none), naming ``option``.

    Raises:
        PipelineError: no CUDA device at all, or ``index`` out of range.
    """
    if count < 1:
        raise PipelineError(f"{option} {spec}: this {library} build sees no CUDA device ({probe}); "
                            f"use {option} cpu or leave {option} out")
    if index is not None and index >= count:
        raise PipelineError(f"{option} {spec}: this machine has {count} CUDA device(s), cuda:0 .. cuda:{count - 1}; "
                            f"use one of them or leave {option} out")


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


def plan_batches(lengths: Sequence[int], max_tokens: int, max_sentences: int | None = None) -> list[list[int]]:
    """Indices grouped into batches of similar length, longest first.

    Sentences are ordered by (length descending, index ascending) and cut greedily so that
    ``len(batch) × max(length in batch) <= max_tokens`` and ``len(batch) <= max_sentences`` (when given); a
    single sentence longer than the budget gets a batch of its own. Zero-length entries are left out
    (nothing to decode).
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    most = len(order) if max_sentences is None else max_sentences
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        if last is not None and len(last) < most and (len(last) + 1) * lengths[last[0]] <= max_tokens:
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


#: Candidate scores per step of one CPU search (sentences × beam × vocabulary): 2^23 fp32 scores, 32 MiB.
#: Searches of 64 sentences (2^21 scores at beam 4 and 8k pieces) left each search's tail, where few
#: sentences are still searching, to matrix products of a few rows; ~256 sentences decoded faster and
#: ~512 slower again (benchmarks/RESULTS.md, "Sentences per CPU search").
CPU_SEARCH_CANDIDATES = 1 << 23

#: Padded source tokens (sentences × longest source) of one CPU search, whatever ``max_tokens`` allows: a
#: search's self-attention buffers and attention work grow with its sentences times their lengths, and on the
#: 2-core CPUs of benchmarks/RESULTS.md searches of 4096 tokens decoded as fast as larger ones on short sentences
#: and faster on long ones (newstest2014: 16384-token searches up to 14% slower; "A token budget for CPU
#: searches"). So on CPU any ``max_tokens`` >= 4096 gives the same searches, and no larger budget is slower.
CPU_SEARCH_TOKENS = 4096


#: With W > 1 workers a CPU search also holds at most 1 / (4W) of the sentences: the searches end at different
#: times, and a few large ones leave workers idle at the end (at a 16k budget 300 newstest2014 sentences were two
#: searches, 131 sentences of up to 125 pieces and 169 of up to 39, so one worker did most of the work;
#: benchmarks/RESULTS.md, "Decoding in rounds").
SEARCHES_PER_WORKER = 4


def cpu_search_sentences(beam_size: int, vocab_size: int, sentences: int = 0, workers: int = 1) -> int:
    """The most sentences in one CPU search: :data:`CPU_SEARCH_CANDIDATES` // (beam × vocabulary), at least 1;
    with ``workers`` > 1 also at most ``sentences`` / (:data:`SEARCHES_PER_WORKER` × workers), rounded up."""
    most = max(1, CPU_SEARCH_CANDIDATES // (beam_size * vocab_size))
    if workers > 1:
        most = min(most, max(1, -(-sentences // (SEARCHES_PER_WORKER * workers))))
    return most


def search_batches(lengths: Sequence[int], max_tokens: int, device: torch.device, cap: int) -> list[list[int]]:
    """:func:`plan_batches` with, on CPU, at most ``cap`` sentences (:func:`cpu_search_sentences`) and
    :data:`CPU_SEARCH_TOKENS` padded tokens per search, every limit applied while cutting: a larger ``max_tokens``
    gives full searches, not a budget's batch cut into full pieces and a short rest. On a GPU a search takes the
    whole ``max_tokens`` batch."""
    if device.type != "cpu":
        return plan_batches(lengths, max_tokens)
    return plan_batches(lengths, min(max_tokens, CPU_SEARCH_TOKENS), cap)


def plan_searches(translator: Translator, sources: Sequence[Sequence[int]], *, beam_size: int, max_len_a: float,
                  max_len_b: float, max_tokens: int, workers: int = 1) -> list[Job]:
    """The searches :func:`decode_sources` runs for these arguments, in the order it starts them.

    Empty sources get none; sentences whose length limit floor(a·S + b) would pass the position table search
    apart, with the limit ``max_positions``.

    Returns:
        One :data:`~pipeline.inference.workers.Job` per search: (sentence indices, their sources, beam size,
        max_len_a, max_len_b).
    """
    cfg, dev = translator.config, translator.device
    lengths = [len(s) for s in sources]
    capped = [max_length(n, max_len_a, max_len_b) > cfg.max_positions for n in lengths]
    cap = cpu_search_sentences(beam_size, cfg.vocab_size, sum(1 for n in lengths if n), workers)
    plain = search_batches([0 if c else n for n, c in zip(lengths, capped)], max_tokens, dev, cap)
    long = search_batches([n if c else 0 for n, c in zip(lengths, capped)], max_tokens, dev, cap)
    return [(batch, [list(sources[i]) for i in batch], beam_size, a, b)
            for batches, a, b in ((plain, max_len_a, max_len_b), (long, 0.0, cfg.max_positions)) for batch in batches]


def decode_sources(
    translator: Translator, sources: Sequence[Sequence[int]], *, beam_size: int, alphas: Sequence[float],
    max_len_a: float, max_len_b: float, max_tokens: int, label: str = "decode", workers: int = 1,
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
        workers: searches run at once on CPU, in the translator's worker processes (forked on first use, kept
            for later calls: :meth:`Translator.search_pool`) with the caller's torch thread count; with more
            than one, searches are also cut smaller so that the workers finish together (the hypotheses do not
            depend on the batching: ``model/beam.py``'s exact rule).

    Returns:
        ``{alpha: hypotheses}``: per α, per sentence in input order, the ids without BOS/EOS.
    """
    if translator.device.type == "cpu":
        allocator.keep_freed_memory()  # each step's [rows × V] tensors reuse the last step's memory
    out = {float(a): [[] for _ in sources] for a in alphas}
    jobs = plan_searches(translator, sources, beam_size=beam_size, max_len_a=max_len_a, max_len_b=max_len_b,
                         max_tokens=max_tokens, workers=workers)
    progress = _Progress(label, beam_size, sum(len(job[0]) for job in jobs))
    for batch, finished in _searches(translator, jobs, workers):
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


def _searches(translator: Translator, jobs: list[Job], n_workers: int) -> Iterator[tuple[list[int], list]]:
    """Every job's result, in order of completion: one by one, or on CPU with ``n_workers`` > 1 in the
    translator's worker processes (:meth:`Translator.search_pool`) with the caller's torch thread count."""
    if n_workers <= 1 or translator.device.type != "cpu" or len(jobs) < 2:
        yield from (_search(translator, job) for job in jobs)
        return
    # each worker's threads: the caller's setting (nmt translate: 1 with --workers)
    yield from translator.search_pool(n_workers, torch.get_num_threads()).imap(jobs)


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


def detokenize(sp: Any, hyps: Sequence[Sequence[int]]) -> list[str]:
    """SentencePiece ids → text with ``sp`` (a SentencePieceProcessor), one line per hypothesis (``[]`` → ``""``;
    never a line break inside)."""
    return [sp.decode([int(t) for t in h]).replace("\n", " ") if h else "" for h in hyps]
