"""Temporary git + DVC repositories for tests that run real ``dvc repro``."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git(repo: Path, *args: str) -> str:
    """Run git in ``repo``; return its stripped stdout (raises on failure)."""
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def init_git_dvc(repo: Path) -> Path:
    """``git init`` with a local identity, then ``dvc init`` without update checks; returns ``repo``."""
    repo.mkdir(parents=True, exist_ok=True)
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "test")
    subprocess.run(["dvc", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["dvc", "config", "core.check_update", "false"], cwd=repo, check=True)
    return repo
