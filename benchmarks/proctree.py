"""A process tree seen through /proc: its processes, their memory and their threads' CPU time (Linux only).

Shared by the benchmarks that measure stages run as subprocesses (``encode.py``, ``scale.py``).
"""

from __future__ import annotations

import os


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc/<pid>/task/<tid>/children)."""
    pids, stack = [], [pid]
    while stack:
        p = stack.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    stack.extend(int(c) for c in fh.read().split())
        except OSError:
            continue
    return pids


def rss_kib(pids: list[int]) -> tuple[int, int]:
    """(largest single-process RSS, sum of RSS) in KiB over ``pids``."""
    sizes = []
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as fh:
                sizes += [int(line.split()[1]) for line in fh if line.startswith("VmRSS:")]
        except OSError:
            pass
    return max(sizes, default=0), sum(sizes)


def cpu_ticks(pids: list[int], seen: dict[tuple[int, int], int]) -> None:
    """Update ``seen[(pid, tid)]`` with each thread's user + system CPU time in clock ticks."""
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            seen[(p, int(tid))] = int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14 and 15)
