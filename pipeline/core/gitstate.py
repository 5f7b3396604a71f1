"""The checkout's commit and what in it differs from the commit: one rule for MLflow's tags and the audit.

A run's own records are not edits: ``dvc.lock`` (DVC rewrites it after every stage) and the versioned
``metrics/`` and ``plots/`` folders (the stages write them; a published run commits them, see the README's DVC
section) never make a checkout dirty. During a ``--profile`` run (``NMT_PROFILE_RUN``) the flow has written
``params.yaml`` for the run and puts the previous bytes back afterwards, so ``params.yaml`` is left out too: the
run's params are then the commit's ``profiles/`` rendered for that profile. Any other tracked change counts.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

RUN_RECORDS = ("dvc.lock", "metrics", "plots")


def _git(root: str | Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def commit(root: str | Path) -> str | None:
    """The checked-out commit of ``root``, or None outside a git checkout (or before the first commit)."""
    out = _git(root, "rev-parse", "HEAD")
    return out.strip() if out else None


def dirty_paths(root: str | Path, *, temporary_params: bool = False) -> list[str]:
    """Tracked paths of ``root`` that differ from its commit, the run's own records left out (module docstring).

    Args:
        root: the checkout.
        temporary_params: a ``--profile`` run: leave ``params.yaml`` out as well.
    """
    excluded = [*RUN_RECORDS, *(["params.yaml"] if temporary_params else [])]
    out = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".",
               *(f":(exclude){p}" for p in excluded)) or ""
    return sorted(line[3:] for line in out.splitlines() if line[3:])
