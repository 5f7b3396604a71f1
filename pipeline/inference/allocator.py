"""glibc's allocator for CPU decoding: keep freed memory in the process instead of handing it back.

A beam-search step on CPU allocates and frees a few tensors of [rows × vocabulary] floats (logits,
log-probabilities, candidate scores: 8 MB each for 256 rows and an 8k vocabulary). glibc serves a
request above its mmap threshold with a fresh ``mmap`` and returns it with ``munmap`` on free, and it
trims the top of the heap once 128 KiB there are free, so every step page-faults again on memory it
used a moment earlier. ``mallopt(3)`` raises the mmap threshold to 32 MiB (its most on 64-bit) and the
trim threshold to 1 GiB, and grows the heap 64 MiB at a time: the freed blocks stay in the heap and the
next step reuses them. Blocks above 32 MiB would still be mapped afresh: a search's self-attention buffers
(``Transformer.init_state``: 12 of about 69 MB for 240 sentences of a d256 model at beam 4), whose pages the
kernel zeroes on first touch in every search (165k page faults, 0.35 s of system time in a 5.9 s decode), so
mmap is switched off too (``M_MMAP_MAX`` 0) and the next search reuses them from the heap. The arithmetic is
unchanged (the same kernels on the same values); the cost is memory the process keeps after decoding
(120-150 MB more peak RSS for a d256 model, measured when a CPU search held 64 sentences; with mmap off
too, 1.01-1.03 vs 0.90-0.92 GB for searches of 240 sentences). ``benchmarks/RESULTS.md`` ("Decoding: search
buffers from the heap" and the older "Decoding" sections) has the effect on this project's sentences per second.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4

#: (parameter, value) pairs set by :func:`keep_freed_memory`.
SETTINGS: tuple[tuple[int, int], ...] = (
    (M_MMAP_THRESHOLD, 32 << 20),
    (M_TRIM_THRESHOLD, 1 << 30),
    (M_TOP_PAD, 64 << 20),
    (M_MMAP_MAX, 0),
)

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply :data:`SETTINGS` once per process (forked children inherit them).

    Returns:
        True when glibc took every setting; False elsewhere (another C library or platform, where
        nothing is changed), logged once at debug level.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("no glibc mallopt here: the allocator keeps its defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    log.debug("glibc allocator: freed memory stays in the heap (%s)", "set" if _applied else "refused")
    return _applied
