"""One dvc.lock per profile: switching profiles (``nmt profile``, a profile run) keeps the live lock as its owner's
and brings back the other profile's, so going back to a built profile rebuilds nothing (tests/pipeline/
test_dvc_experiments.py checks that with DVC itself)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.project.locks import KEPT, live_owner
from pipeline.project.profiles import SAVED, profile_run, restore_params, write_profile
from tests.helpers.paths import REPO


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A project with profiles/, a .dvc folder and the tiny profile's params.yaml and lock."""
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc" / "config").write_text("")  # what `dvc init` leaves
    write_profile("tiny", tmp_path)
    (tmp_path / "dvc.lock").write_text("tiny's lock\n")
    return tmp_path


def test_a_switch_keeps_the_lock_and_switching_back_brings_it_back(root: Path) -> None:
    write_profile("demo", root)
    assert (root / KEPT / "tiny" / "dvc.lock").read_text() == "tiny's lock\n" and live_owner(root) == "demo"
    assert (root / "dvc.lock").read_text() == "tiny's lock\n"  # none of demo's yet: DVC reruns what differs
    (root / "dvc.lock").write_text("demo's lock\n")  # what dvc repro wrote for demo
    write_profile("tiny", root)
    assert (root / "dvc.lock").read_text() == "tiny's lock\n"
    assert (root / KEPT / "demo" / "dvc.lock").read_text() == "demo's lock\n"


def test_a_profile_run_gives_the_lock_back_after_it(root: Path) -> None:
    with profile_run("demo", root):
        (root / "dvc.lock").write_text("demo's lock\n")
    assert (root / "dvc.lock").read_text() == "tiny's lock\n" and live_owner(root) == "tiny"
    with profile_run("demo", root):
        assert (root / "dvc.lock").read_text() == "demo's lock\n"


def test_a_killed_profile_run_is_undone_with_its_lock(root: Path) -> None:
    run = profile_run("demo", root)
    run.__enter__()  # killed inside: params.yaml and the lock stay demo's, nothing undone yet
    (root / "dvc.lock").write_text("demo's lock\n")
    assert (root / SAVED).is_file()
    assert restore_params(root)  # what the next run or `nmt profile` does first
    assert (root / "dvc.lock").read_text() == "tiny's lock\n"
    assert (root / KEPT / "demo" / "dvc.lock").read_text() == "demo's lock\n"


def test_outside_a_dvc_project_nothing_is_kept(tmp_path: Path) -> None:
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    (tmp_path / "dvc.lock").write_text("someone's\n")
    write_profile("tiny", tmp_path)
    write_profile("demo", tmp_path)
    assert (tmp_path / "dvc.lock").read_text() == "someone's\n" and not (tmp_path / KEPT).exists()
