"""Global batches: the pairs of each optimizer step depend on the data, the seed, the epoch and the step only.

The plan is fairseq's ``ordered_indices`` + ``batch_by_size`` with the budget in target tokens (the paper's
§5.1); the ranks and ``NMT_MAX_TOKENS`` only decide who computes which pairs in which forward pass.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.core.errors import DataError

log = logging.getLogger(__name__)
_PLAN_STREAM = 0x5EED_BA7C
_EPOCH_STREAM = 0x5EED_E90C


def token_lengths(src_len: np.ndarray, tgt_len: np.ndarray) -> np.ndarray:
    """Per-pair cost length: max(src_len + 1, tgt_len + 1) (EOS on the source, BOS/EOS on the target)."""
    return np.maximum(np.asarray(src_len, np.int64), np.asarray(tgt_len, np.int64)) + 1


@dataclass(frozen=True)
class GlobalBatch:
    """The pairs of one optimizer step, shortest first."""

    ids: np.ndarray  # [n] int64 example ids
    lengths: np.ndarray  # [n] int64 cost lengths (token_lengths)
    tgt_tokens: int  # non-pad target tokens (targets + EOS)

    def share(self, rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Rank ``rank``'s pairs, every ``world_size``-th one: (ids, lengths)."""
        return self.ids[rank::world_size], self.lengths[rank::world_size]


def plan_global_batches(ids: np.ndarray, lengths: np.ndarray, tgt_tokens: np.ndarray, *, tokens_per_step: int,
                        seed: int) -> list[GlobalBatch]:
    """Cut ids [N] (ties of ``lengths`` [N] broken by ``seed``) into global batches, each as full of ``tgt_tokens``
    [N] (target + EOS) as ``tokens_per_step`` allows; shortest pairs first.

    Raises:
        DataError: one pair alone has more target tokens than ``tokens_per_step``.
    """
    ids, lengths, tgt_tokens = (np.asarray(a, np.int64) for a in (ids, lengths, tgt_tokens))
    if len(ids) and tgt_tokens.max() > tokens_per_step:
        worst = int(np.argmax(tgt_tokens))
        raise DataError(f"example id {ids[worst]} has {tgt_tokens[worst]} target tokens > train.tokens_per_step "
                        f"({tokens_per_step}): no step could hold it; raise train.tokens_per_step or lower "
                        "encode.max_len and rerun encode")
    perm = np.random.default_rng([seed, _PLAN_STREAM]).permutation(len(ids))
    order = perm[np.argsort(lengths[perm], kind="stable")]
    cum = np.cumsum(tgt_tokens[order])
    batches: list[GlobalBatch] = []
    start, n = 0, len(order)
    while start < n:
        before = int(cum[start - 1]) if start else 0
        end = max(start + 1, int(np.searchsorted(cum, before + tokens_per_step, side="right")))
        chosen = order[start:end]
        batches.append(GlobalBatch(ids[chosen], lengths[chosen], int(cum[end - 1]) - before))
        start = end
    return batches


def plan_batches(ids: np.ndarray, lengths: np.ndarray, *, max_tokens: int, seed: int | None) -> list[np.ndarray]:
    """Pack ids [N] by ``lengths`` [N] greedily into as few forward passes of at most ``max_tokens`` padded tokens
    (sentences × longest) as it can, shortest first; ``seed`` breaks ties (None: id order).

    Raises:
        DataError: a single pair is longer than ``max_tokens`` (``NMT_MAX_TOKENS``, named).
    """
    ids, lengths = np.asarray(ids, np.int64), np.asarray(lengths, np.int64)
    if len(ids) and lengths.max() > max_tokens:
        worst = int(np.argmax(lengths))
        raise DataError(f"example id {ids[worst]} needs {lengths[worst]} tokens > NMT_MAX_TOKENS ({max_tokens}); "
                        "raise NMT_MAX_TOKENS or lower encode.max_len and rerun encode")
    perm = (np.random.default_rng([seed, _PLAN_STREAM]).permutation(len(ids)) if seed is not None
            else np.arange(len(ids)))
    order = perm[np.argsort(lengths[perm], kind="stable")]
    sorted_len = lengths[order]
    batches: list[np.ndarray] = []
    start, n = 0, len(order)
    while start < n:
        # Lengths are ascending, so a batch's longest is its last; the cost count × last grows with
        # the end index: the window of candidates is bounded by max_tokens // shortest.
        window = sorted_len[start:start + max(1, max_tokens // max(1, int(sorted_len[start])))]
        cost = np.arange(1, len(window) + 1) * window
        size = max(1, int(np.searchsorted(cost, max_tokens, side="right")))
        batches.append(ids[order[start:start + size]])
        start += size
    return batches


def forward_passes(batch: GlobalBatch, *, rank: int, world_size: int, max_tokens: int) -> list[np.ndarray]:
    """Rank ``rank``'s share of ``batch`` as id arrays, one per forward pass of <= ``max_tokens`` padded tokens."""
    ids, lengths = batch.share(rank, world_size)
    return plan_batches(ids, lengths, max_tokens=max_tokens, seed=None) if len(ids) else []


def forward_shapes(plan: Sequence[GlobalBatch], *, rank: int, world_size: int,
                   max_tokens: int) -> list[tuple[int, int]]:
    """Every forward-pass shape ``(sentences, longest)`` rank ``rank`` runs over one epoch of ``plan``."""
    shapes = []
    for batch in plan:
        where = dict(zip(*(a.tolist() for a in batch.share(rank, world_size))))
        shapes += [(len(chunk), max(where[i] for i in chunk.tolist()))
                   for chunk in forward_passes(batch, rank=rank, world_size=world_size, max_tokens=max_tokens)]
    return shapes


def valid_plan(ids: np.ndarray, lengths: np.ndarray, *, max_tokens: int, max_positions: int) -> list[np.ndarray]:
    """Batches of a valid/test split in length order; pairs longer than ``max_positions`` skipped with a warning."""
    ids, lengths = np.asarray(ids, np.int64), np.asarray(lengths, np.int64)
    fits = lengths <= max_positions
    if not fits.all():
        log.warning("validation skips %d of %d pairs longer than model.max_positions (%d)", int((~fits).sum()),
                    len(ids), max_positions)
    budget = max(max_tokens, int(lengths[fits].max(initial=0)))
    return plan_batches(ids[fits], lengths[fits], max_tokens=budget, seed=None)


def epoch_order(n_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The batch order of ``epoch``: a permutation of ``range(n_batches)`` from (seed, epoch)."""
    return np.random.default_rng([seed, _EPOCH_STREAM, epoch]).permutation(n_batches)


def epoch_steps(plan: Sequence[GlobalBatch], fetch, *, seed: int, epoch: int, start: int, rank: int,
                world_size: int, max_tokens: int, pin: bool = False, **ids) -> Iterator[list[Batch]]:
    """This rank's :class:`Batch` es for each step of ``epoch`` from ``start``, built ahead by :func:`prefetch`."""
    order = epoch_order(len(plan), seed, epoch)
    passes = [forward_passes(plan[order[p]], rank=rank, world_size=world_size, max_tokens=max_tokens)
              for p in range(start, len(plan))]
    jobs = [((p, f), chunk) for p, chunks in zip(range(start, len(plan)), passes) for f, chunk in enumerate(chunks)]
    items = prefetch(fetch, jobs, pin=pin, **ids)
    try:
        for chunks in passes:
            yield [next(items) for _ in chunks]
    finally:
        items.close()


@dataclass
class Batch:
    """One micro-batch as tensors."""

    src: torch.Tensor  # [B, S] int64 source ids + EOS, right-padded
    tgt_in: torch.Tensor  # [B, T] int64 BOS + target ids, padded
    tgt_out: torch.Tensor  # [B, T] int64 target ids + EOS, padded (the loss target)
    n_tokens: int  # non-pad target tokens
    index: int = -1  # position of its global batch in the epoch (-1: validation)
    forward: int = 0  # which of this rank's forward passes of that step it is
    n_src: int = 0  # non-pad source tokens (ids + EOS)

    def to(self, device: torch.device) -> Batch:
        """The same batch on ``device`` (non-blocking from pinned memory)."""
        nb = device.type == "cuda"
        return Batch(self.src.to(device, non_blocking=nb), self.tgt_in.to(device, non_blocking=nb),
                     self.tgt_out.to(device, non_blocking=nb), self.n_tokens, self.index, self.forward, self.n_src)


def collate(pairs: Sequence[tuple[np.ndarray, np.ndarray]], *, pad_id: int, bos_id: int, eos_id: int,
            index: int = -1, forward: int = 0, pin: bool = False) -> Batch:
    """Pad ``(src, tgt)`` id arrays into a :class:`Batch` (source ids + EOS, BOS + target ids, target ids + EOS)."""
    src = np.full((len(pairs), max(len(s) for s, _ in pairs) + 1), pad_id, np.int64)
    tgt_in, tgt_out = np.full((2, len(pairs), max(len(t) for _, t in pairs) + 1), pad_id, np.int64)
    for i, (s, t) in enumerate(pairs):
        src[i, :len(s)] = s
        src[i, len(s)] = eos_id
        tgt_in[i, 0] = bos_id
        tgt_in[i, 1:len(t) + 1] = t
        tgt_out[i, :len(t)] = t
        tgt_out[i, len(t)] = eos_id
    n_tokens = sum(len(t) + 1 for _, t in pairs)
    tensors = [torch.from_numpy(a) for a in (src, tgt_in, tgt_out)]
    if pin:
        tensors = [t.pin_memory() for t in tensors]
    return Batch(*tensors, n_tokens=n_tokens, index=index, forward=forward, n_src=sum(len(s) + 1 for s, _ in pairs))


def prefetch(fetch, jobs: Iterable[tuple[tuple[int, int], np.ndarray]], *, depth: int = 2,
             **collate_kw) -> Iterator[Batch]:
    """The :class:`Batch` es of ``jobs`` in order, built from ``fetch`` in a thread up to ``depth`` ahead."""
    def build(job: tuple[tuple[int, int], np.ndarray]) -> Batch:
        (position, forward), ids = job
        return collate(fetch(ids), index=position, forward=forward, **collate_kw)

    with cf.ThreadPoolExecutor(1, thread_name_prefix="batch-prefetch") as pool:
        todo = iter(jobs)
        ahead = collections.deque(pool.submit(build, job) for job in itertools.islice(todo, depth))
        try:
            while ahead:
                batch = ahead.popleft().result()
                ahead.extend(pool.submit(build, job) for job in itertools.islice(todo, 1))
                yield batch
        finally:
            for future in ahead:
                future.cancel()
