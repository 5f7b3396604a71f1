"""What the benchmark scripts share: logging, the header of a result (date, command, machine), its JSON file, a
params.yaml and a markdown table."""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from datetime import date
from pathlib import Path

import psutil

from pipeline.core.record import Machine

REPO = Path(__file__).resolve().parents[1]


def setup_logging() -> None:
    """Progress lines with the time of day, on stderr (stdout carries the table)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")


def header(argv: Sequence[str]) -> dict[str, object]:
    """Date, command line, machine, CPU model, CPU count and memory: what a result needs to be compared."""
    return {"date": date.today().isoformat(), "command": " ".join([Path(sys.argv[0]).name, *argv]),
            "machine": platform.platform(), "processor": Machine.here().cpu, "cpus": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
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
