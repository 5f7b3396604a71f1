"""A profile run holds its params.yaml for the run only: the previous bytes come back however the run ends."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.errors import ConfigError
from pipeline.project.profiles import ABSENT, SAVED, profile_run, render, restore_params
from tests.helpers.paths import REPO

HAND_EDITED = b"# my own params, CRLF kept\r\nprofile: paper\r\n"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    (tmp_path / "params.yaml").write_bytes(HAND_EDITED)
    return tmp_path


def test_the_profile_holds_during_the_run_and_the_bytes_come_back(root: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pipeline.project.profiles")
    with profile_run("tiny", root) as target:
        assert target.read_text(encoding="utf-8") == render("tiny", root)
        assert yaml.safe_load(target.read_text())["profile"] == "tiny"
    assert (root / "params.yaml").read_bytes() == HAND_EDITED
    assert not (root / SAVED).exists() and not list(root.glob("params.yaml.*"))  # no backup of a restored file
    assert f"restored {root / 'params.yaml'} as it was before the profile run" in caplog.text


def test_an_error_in_the_run_restores_too(root: Path) -> None:
    with pytest.raises(KeyboardInterrupt), profile_run("demo", root):
        raise KeyboardInterrupt
    assert (root / "params.yaml").read_bytes() == HAND_EDITED


def test_no_params_yaml_before_means_none_after(root: Path) -> None:
    (root / "params.yaml").unlink()
    with profile_run("tiny", root):
        assert (root / "params.yaml").is_file() and (root / ABSENT).is_file()
    assert not (root / "params.yaml").exists() and not (root / ABSENT).exists()


def test_an_unknown_profile_touches_nothing(root: Path) -> None:
    with pytest.raises(ConfigError, match="no such profile 'huge'"), profile_run("huge", root):
        pass
    assert (root / "params.yaml").read_bytes() == HAND_EDITED and not (root / SAVED).exists()


def test_a_killed_run_is_undone_by_the_next(root: Path) -> None:
    """SIGKILL runs no Python: the replaced bytes wait in .dvc/tmp until :func:`restore_params` runs."""
    script = ("import os, signal, sys; from pipeline.project.profiles import profile_run\n"
              "with profile_run('tiny', sys.argv[1]):\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", script, str(root)], cwd=REPO, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == -signal.SIGKILL
    assert yaml.safe_load((root / "params.yaml").read_text())["profile"] == "tiny"
    assert restore_params(root) is True
    assert (root / "params.yaml").read_bytes() == HAND_EDITED
    assert restore_params(root) is False  # nothing left to undo
