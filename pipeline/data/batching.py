"""Token-budget batches: planned once, shuffled per epoch, sliced per rank, prefetched.

The plan (fairseq's ``ordered_indices`` + ``batch_by_size``): a seeded permutation of the ids,
stable-sorted by length (the longer of source+EOS and BOS+target), packed greedily so that
``sentences × longest <= max_tokens`` (padding counts). The list of batches is then frozen.
Each epoch shuffles the batch list with (seed, epoch). Global micro-batch ``g`` of an epoch is
``order[g]``; optimizer step ``s`` of the epoch consumes ``g = s·W·A ... (s+1)·W·A - 1``, rank
``r`` running ``g = s·W·A + a·W + r`` for ``a < A``. Indices past the end of the epoch are
empty micro-batches (``None``), so every rank runs the same number of steps. The iterator's
whole state is ``(epoch, g)``, which is what a checkpoint stores.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Iterator, Sequence
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


def plan_batches(ids: np.ndarray, lengths: np.ndarray, *, max_tokens: int, seed: int | None) -> list[np.ndarray]:
    """Pack ``ids`` into micro-batches of at most ``max_tokens`` padded tokens.

    Args:
        ids: [N] int64 example ids.
        lengths: [N] cost lengths (see :func:`token_lengths`), aligned with ``ids``.
        max_tokens: budget per micro-batch, counting padding (sentences × longest).
        seed: seed of the tie-breaking permutation; ``None`` keeps id order among equal lengths.

    Returns:
        The frozen batch list (shortest sentences first), each an int64 array of ids.

    Raises:
        DataError: a single pair is longer than ``max_tokens``.
    """
    ids = np.asarray(ids, np.int64)
    lengths = np.asarray(lengths, np.int64)
    if ids.shape != lengths.shape:
        raise ValueError(f"ids {ids.shape} and lengths {lengths.shape} differ in shape")
    if len(ids) and lengths.max() > max_tokens:
        worst = int(np.argmax(lengths))
        raise DataError(f"example id {ids[worst]} needs {lengths[worst]} tokens > train.max_tokens ({max_tokens}); "
                        "raise train.max_tokens or lower encode.max_len and rerun encode")
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


def valid_plan(ids: np.ndarray, lengths: np.ndarray, *, max_tokens: int, max_positions: int) -> list[np.ndarray]:
    """Batches of a split that is never length-filtered upstream (valid/test), in length order.

    The budget grows to the longest pair that fits the model; pairs longer than ``max_positions``
    are skipped with a warning (the model could not embed them).
    """
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


def accumulation(tokens_per_step: int, world_size: int, max_tokens: int) -> int:
    """Micro-batches per rank per optimizer step: ceil(tokens_per_step / (world_size × max_tokens))."""
    return max(1, math.ceil(tokens_per_step / (world_size * max_tokens)))


def steps_in_epoch(n_batches: int, start: int, world_size: int, accum: int) -> int:
    """Optimizer steps needed to consume global micro-batches ``start .. n_batches - 1``."""
    return math.ceil(max(0, n_batches - start) / (world_size * accum))


def rank_schedule(n_batches: int, *, start: int, rank: int, world_size: int, accum: int) -> list[list[int | None]]:
    """Global micro-batch indices that ``rank`` runs, per optimizer step, from ``start`` to the epoch end.

    Returns:
        One list of ``accum`` entries per step; ``None`` marks an empty micro-batch past the end.
        Every rank gets the same number of steps and the ranks' indices are disjoint.
    """
    per_step = world_size * accum
    out = []
    for s in range(steps_in_epoch(n_batches, start, world_size, accum)):
        base = start + s * per_step
        out.append([g if (g := base + a * world_size + rank) < n_batches else None for a in range(accum)])
    return out


def epoch_steps(batches: Sequence[np.ndarray], fetch, *, seed: int, epoch: int, start: int, rank: int,
                world_size: int, accum: int, pin: bool = False, **ids) -> Iterator[list[Batch | None]]:
    """This rank's micro-batches for each remaining step of ``epoch``, built ahead by a :class:`Prefetcher`.

    Args:
        batches: the frozen plan; fetch: ``ShardSet.fetch``; start: first global micro-batch index.
        ids: ``pad_id``, ``bos_id``, ``eos_id`` for :func:`collate`.

    Yields:
        Lists of ``accum`` entries, each a :class:`Batch` or None (an empty micro-batch).
    """
    order = epoch_order(len(batches), seed, epoch)
    schedule = rank_schedule(len(batches), start=start, rank=rank, world_size=world_size, accum=accum)
    jobs = [(g, None if g is None else batches[order[g]]) for step in schedule for g in step]
    pre = Prefetcher(fetch, jobs, pin=pin, **ids)
    try:
        items = iter(pre)
        for _ in schedule:
            yield [next(items) for _ in range(accum)]
    finally:
        pre.close()


@dataclass
class Batch:
    """One micro-batch as tensors.

    Attributes:
        src: [B, S] int64 source ids + EOS, right-padded with pad.
        tgt_in: [B, T] int64 BOS + target ids, padded.
        tgt_out: [B, T] int64 target ids + EOS, padded (the loss target).
        n_tokens: non-pad target tokens (``(tgt_out != pad).sum()``).
        index: global micro-batch index in the epoch (``-1`` for validation).
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    n_tokens: int
    index: int = -1

    def to(self, device: torch.device) -> Batch:
        """The same batch on ``device`` (non-blocking from pinned memory)."""
        nb = device.type == "cuda"
        return Batch(self.src.to(device, non_blocking=nb), self.tgt_in.to(device, non_blocking=nb),
                     self.tgt_out.to(device, non_blocking=nb), self.n_tokens, self.index)


def collate(pairs: Sequence[tuple[np.ndarray, np.ndarray]], *, pad_id: int, bos_id: int, eos_id: int,
            index: int = -1, pin: bool = False) -> Batch:
    """Pad ``(src, tgt)`` id arrays into a :class:`Batch` (source = ids + EOS, decoder input = BOS + ids, target = ids + EOS)."""
    b = len(pairs)
    s_max = max(len(s) for s, _ in pairs) + 1
    t_max = max(len(t) for _, t in pairs) + 1
    src = np.full((b, s_max), pad_id, np.int64)
    tgt_in = np.full((b, t_max), pad_id, np.int64)
    tgt_out = np.full((b, t_max), pad_id, np.int64)
    n_tokens = 0
    for i, (s, t) in enumerate(pairs):
        src[i, :len(s)] = s
        src[i, len(s)] = eos_id
        tgt_in[i, 0] = bos_id
        tgt_in[i, 1:len(t) + 1] = t
        tgt_out[i, :len(t)] = t
        tgt_out[i, len(t)] = eos_id
        n_tokens += len(t) + 1
    tensors = [torch.from_numpy(a) for a in (src, tgt_in, tgt_out)]
    if pin:
        tensors = [t.pin_memory() for t in tensors]
    return Batch(*tensors, n_tokens=n_tokens, index=index)


class Prefetcher:
    """Builds the next micro-batches in a background thread while the current one trains.

    Args:
        fetch: maps a sequence of ids to ``(src, tgt)`` arrays (``ShardSet.fetch``).
        jobs: ``(global index, ids or None)`` in the order they will be consumed.
        depth: batches built ahead.
        collate_kw: keyword arguments of :func:`collate` (pad/bos/eos ids, pin).

    Iterating yields ``Batch`` or ``None`` (an empty micro-batch) in job order.
    """

    def __init__(self, fetch, jobs: Sequence[tuple[int, np.ndarray | None]], *, depth: int = 2,
                 **collate_kw) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._n = len(jobs)
        self._thread = threading.Thread(target=self._work, args=(fetch, list(jobs), collate_kw), daemon=True,
                                        name="batch-prefetch")
        self._thread.start()

    def _work(self, fetch, jobs, collate_kw) -> None:
        try:
            for g, ids in jobs:
                item = None if ids is None else collate(fetch(ids), index=g, **collate_kw)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
            self._queue.put(exc)

    def __iter__(self) -> Iterator[Batch | None]:
        for _ in range(self._n):
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop the worker thread (safe to call twice)."""
        self._stop.set()
        self._thread.join(timeout=5)
