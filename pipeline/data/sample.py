"""The bpe stage's training text: a seeded sample of lines, streamed in file order a block at a time, never a
list or a file (at the paper's sample size a copy would be the whole 1.3 GB corpus)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeline.core.errors import DataError
from pipeline.core.textio import line_offsets, read_line_block

log = logging.getLogger(__name__)

PROGRESS_EVERY = 1_000_000  # sentences between progress lines while SentencePiece reads the sample
READ_BLOCK = 100_000  # lines read and decoded at once


def sample_indices(total: int, k: int, seed: int) -> np.ndarray:
    """Sorted indices of a seeded sample of ``min(k, total)`` distinct lines out of ``total``."""
    if k <= 0 or k >= total:
        return np.arange(total, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(seed))
    return np.sort(rng.choice(total, size=k, replace=False)).astype(np.int64)


class Sample:
    """A seeded sample of the non-empty lines of ``files`` (as one sequence), read in file order as it is iterated.

    ``count``: sentences yielded so far; ``error``: a DataError met while reading, kept because SentencePiece
    turns an exception in its iterator into a ``RuntimeError`` that has lost the file and line.
    """

    def __init__(self, files: list[Path], k: int, seed: int) -> None:
        self.files = files
        found = [line_offsets(path, READ_BLOCK) for path in files]
        self.offsets, self.counts = [offsets for offsets, _ in found], [n for _, n in found]
        self.chosen = sample_indices(sum(self.counts), k, seed)
        self.count = 0
        self.error: DataError | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._lines()
        except DataError as exc:
            self.error = exc
            raise

    def _lines(self) -> Iterator[str]:
        self.count = base = 0
        chosen = self.chosen
        for path, offsets, n in zip(self.files, self.offsets, self.counts):
            for k, (start, end) in enumerate(zip(offsets, offsets[1:] + [-1])):
                lines = read_line_block(path, start, end, k * READ_BLOCK)
                first = base + k * READ_BLOCK
                lo, hi = np.searchsorted(chosen, [first, first + len(lines)]).tolist()
                picked = lines if hi - lo == len(lines) else [lines[i - first] for i in chosen[lo:hi].tolist()]
                picked = [line for line in picked if line]
                if (self.count + len(picked)) // PROGRESS_EVERY > self.count // PROGRESS_EVERY:
                    log.info("bpe: %d/%d sampled lines read", hi, len(chosen))
                self.count += len(picked)
                yield from picked
            base += n
        log.info("bpe: all %d sentences of the sample read", self.count)
