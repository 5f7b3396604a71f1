"""The checkout's commit and its edits (a run's own records are none), for MLflow's tags and the audit."""

from __future__ import annotations

import subprocess
from pathlib import Path

RUN_RECORDS = ("dvc.lock", "metrics", "plots")


def _git(root: str | Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def commit(root: str | Path) -> str | None:
    """The checked-out commit of ``root``, or None outside a git checkout (or before the first commit)."""
    out = _git(root, "rev-parse", "HEAD")
    return out.strip() if out else None


def dirty_paths(root: str | Path, *, temporary_params: bool = False) -> list[str]:
    """Tracked paths of ``root`` that differ from its commit, the run's own records left out."""
    excluded = [*RUN_RECORDS, *(["params.yaml"] if temporary_params else [])]
    out = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".",
               *(f":(exclude){p}" for p in excluded)) or ""
    return sorted(line[3:] for line in out.splitlines() if line[3:])
