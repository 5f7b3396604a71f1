"""What the benchmark scripts share: logging, the header of a result (date, command, machine), its JSON file, a
markdown table, and a process tree seen through /proc (Linux only) for the stages measured as subprocesses."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def setup_logging() -> None:
    """Progress lines with the time of day, on stderr (stdout carries the table)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)


def header(argv: Sequence[str]) -> dict[str, object]:
    """Date, command line, machine, CPU model, CPU count and memory: what a result needs to be compared."""
    processor = platform.processor()
    try:
        processor = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("model name")), processor)
        memory_gib = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        memory_gib = 0.0
    return {"date": date.today().isoformat(), "command": " ".join([Path(sys.argv[0]).name, *argv]),
            "machine": platform.platform(), "processor": processor, "cpus": os.cpu_count(), "memory_gib": memory_gib,
            "python": platform.python_version()}


def write_json(path: Path, result: object) -> None:
    """``result`` as indented JSON at ``path`` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def md_table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: the header row, the rule, one line per row."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


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


def watch(proc: subprocess.Popen, every: float, also: Callable[[int, list[int]], None] | None = None) -> tuple[int, int]:
    """Sample ``proc``'s process tree every ``every`` seconds until it exits (``also(i, pids)`` at sample ``i``).

    Returns:
        The peak RSS in KiB of its largest process and of the whole tree.
    """
    peak_one = peak_tree = sample = 0
    while proc.poll() is None:
        pids = tree_pids(proc.pid)
        one, tree = rss_kib(pids)
        peak_one, peak_tree = max(peak_one, one), max(peak_tree, tree)
        if also is not None:
            also(sample, pids)
        sample += 1
        time.sleep(every)
    return peak_one, peak_tree
