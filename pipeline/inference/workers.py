"""CPU search workers: processes forked once per loaded model and reused by every later decode.

A worker process inherits the model when it is forked (threads would share one GIL) and keeps it; each job carries
its own source rows. Forking anew for every decode cost each worker its first search's page faults again (its heap
copied on write from the parent's: 74-88k minor faults in a first search of 125 d256 sentences, 8-23k in later
ones; benchmarks/RESULTS.md, "Decoding: search buffers from the heap"), and a stream translated chunk by chunk
(``nmt translate --workers``) forked once per chunk.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

#: (sentence indices, their source rows, beam size, max_len_a, max_len_b): one search.
Job = tuple[list[int], list[list[int]], int, float, float]
SearchFn = Callable[[Any, Job], tuple[list[int], list]]

#: What a worker forked by :class:`SearchPool` runs on: (the model's holder, the search function); set in the
#: parent only while it forks.
_INHERITED: tuple[Any, SearchFn] | None = None


def _run(job: Job) -> tuple[list[int], list]:
    assert _INHERITED is not None, "search workers are forked by SearchPool"
    holder, search = _INHERITED
    return search(holder, job)


class SearchPool:
    """``workers`` forked processes with ``threads`` torch threads each, running ``search(holder, job)``.

    The workers see ``holder`` (a loaded translator) as it was when the pool was made: build a new pool after
    changing its weights. :meth:`close` ends the workers; a pool not closed ends them when it is collected or
    at interpreter exit (``multiprocessing.pool.Pool``).
    """

    def __init__(self, holder: Any, search: SearchFn, workers: int, threads: int) -> None:
        global _INHERITED
        _INHERITED = (holder, search)
        try:
            self._pool: multiprocessing.pool.Pool | None = multiprocessing.get_context("fork").Pool(
                workers, initializer=torch.set_num_threads, initargs=(threads,))
        finally:
            _INHERITED = None
        self.workers, self.threads = workers, threads

    def imap(self, jobs: Sequence[Job]) -> Iterator[tuple[list[int], list]]:
        """Every job's result, in order of completion."""
        if self._pool is None:
            raise RuntimeError("this SearchPool is closed; make a new one")
        return self._pool.imap_unordered(_run, jobs)

    def close(self) -> None:
        """End the worker processes (idempotent)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
