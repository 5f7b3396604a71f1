"""What the benchmark scripts share: logging, the header of a result (date, command, machine), its JSON file, a
params.yaml, a markdown table, and a process tree seen through /proc (Linux only) for stages run as subprocesses."""

from __future__ import annotations

import contextlib
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")


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


def write_params(params: dict, folder: Path) -> Path:
    """``folder/params.yaml`` holding ``params`` (the folder made)."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    (path := folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return path


def md_table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: the header row, the rule, one line per row."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc/<pid>/task/<tid>/children)."""
    pids, stack = [], [pid]
    while stack:
        pids.append(p := stack.pop())
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                stack += map(int, Path(f"/proc/{p}/task/{task}/children").read_text().split())
    return pids


def rss_kib(pids: list[int]) -> tuple[int, int]:
    """(largest single-process RSS, sum of RSS) in KiB over ``pids``."""
    sizes = []
    for p in pids:
        with contextlib.suppress(OSError):
            sizes += [int(line.split()[1]) for line in Path(f"/proc/{p}/status").read_text().splitlines()
                      if line.startswith("VmRSS:")]
    return max(sizes, default=0), sum(sizes)


def cpu_ticks(pids: list[int], seen: dict[tuple[int, int], int]) -> None:
    """Update ``seen[(pid, tid)]`` with each thread's user + system CPU time in clock ticks."""
    for p in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    fields = Path(f"/proc/{p}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                    seen[(p, int(tid))] = int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14, 15)


def watch(proc: subprocess.Popen, every: float, also: Callable[[int, list[int]], None] | None = None
          ) -> tuple[int, int]:
    """Sample ``proc``'s process tree every ``every`` seconds until it exits (``also(i, pids)`` at sample ``i``):
    the peak RSS in KiB of its largest process and of the whole tree."""
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
