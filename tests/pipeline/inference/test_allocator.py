"""The allocator setting CPU decoding applies: large freed blocks stay in the heap (no mmap per step or search)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers.paths import REPO

# In a fresh process: free a 16 MiB tensor (glibc mmaps it and then raises its mmap threshold to 16 MiB),
# optionally apply the setting, then count glibc's mmapped blocks while a 24 MiB tensor is alive, and while a
# 64 MiB one is (above the largest mmap threshold glibc accepts, 32 MiB).
_PROBE = textwrap.dedent("""
    import ctypes, sys
    import torch
    libc = ctypes.CDLL("libc.so.6")
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc.mallinfo2.restype = Info
    def mmapped_while_alive(n_bytes):
        base = libc.mallinfo2().hblks
        x = torch.empty(n_bytes // 4)
        count = libc.mallinfo2().hblks - base
        del x
        return count
    first = mmapped_while_alive(16 << 20)
    if sys.argv[1] == "set":
        from pipeline.inference.allocator import keep_freed_memory
        assert keep_freed_memory() and keep_freed_memory()
    print(first, mmapped_while_alive(24 << 20), mmapped_while_alive(64 << 20))
""")


def _probe(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return [int(x) for x in done.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_blocks_stay_in_the_heap_once_set() -> None:
    if subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libc.so.6').mallinfo2"],
                      capture_output=True).returncode != 0:
        pytest.skip("glibc without mallinfo2 (< 2.33): the probe cannot count mmapped blocks")
    assert _probe("default") == [1, 1, 1]  # the control: glibc maps every block by default
    assert _probe("set") == [1, 0, 0]  # after keep_freed_memory() both later blocks come from the heap
