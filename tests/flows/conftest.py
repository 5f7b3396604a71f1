"""Fixtures of the flow tests: the toy git + DVC repository (``tests/helpers/toyflow.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.repoutil import init_git_dvc
from tests.helpers.toyflow import MakeRepo, make_toy_repo


@pytest.fixture(scope="session")
def empty_dvc_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty git + DVC repo, made once (``dvc init`` is the slow part) and copied per test."""
    repo = tmp_path_factory.mktemp("template") / "repo"
    repo.mkdir()
    init_git_dvc(repo)
    return repo


@pytest.fixture
def make_repo(tmp_path: Path, repo_root: Path, empty_dvc_repo: Path) -> MakeRepo:
    """Build a repo with ``toy.py``, the paper profile as params.yaml, the profiles, and the given stages."""
    def make(stages: dict[str, dict]) -> Path:
        return make_toy_repo(empty_dvc_repo, tmp_path / "toy", repo_root, stages)
    return make
