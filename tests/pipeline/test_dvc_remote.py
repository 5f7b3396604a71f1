"""Results travel through DVC's own remote and run cache: clone A, a copy of the tiny project ``dvc repro`` built
(``tiny_built``), pushes (the committed ``.dvc/config``'s default remote, a plain folder under ``~/.cache``); clone B
at the same commit, with no dvc.lock committed (a scheduled run's), restores every stage with ``dvc repro --pull``
and runs none."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import REPO
from tests.helpers.repoutil import git
from tests.helpers.tinyproject import CHEAP_EVALUATE, built_env, copy_built

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)


def _dvc(repo: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run(["dvc", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"dvc {' '.join(args)}: " + done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _project_with_committed_config(tiny_built: Path, dest: Path) -> Path:
    """A copy of the built tiny project (its params.yaml holds the cheap evaluate params) with this checkout's
    .dvc/config, both committed (dvc.lock is not: a scheduled run's checkout has none)."""
    repo = copy_built(tiny_built, dest)
    shutil.copy(REPO / ".dvc" / "config", repo / ".dvc" / "config")
    params = yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8"))
    assert {key: params["evaluate"][key] for key in CHEAP_EVALUATE} == CHEAP_EVALUATE
    git(repo, "add", "params.yaml", ".dvc/config")
    git(repo, "commit", "-qm", "the committed DVC config and cheap evaluate params")
    return repo


def test_a_fresh_clone_restores_every_stage_from_the_default_remote_and_runs_none(tiny_built: Path,
                                                                                   tmp_path: Path) -> None:
    env = {**os.environ, **built_env(tiny_built), "HOME": str(tmp_path / "home")}  # ~ of the default remote's url
    a = _project_with_committed_config(tiny_built, tmp_path / "a")
    assert "Data and pipelines are up to date." in _dvc(a, env, "status")  # every stage ran in A (tiny_built)
    assert (a / "runs" / "tiny" / "train").is_dir()
    _dvc(a, env, "push", "--run-cache")
    remote = tmp_path / "home" / ".cache" / "wmt14-transformer" / "dvc-remote"
    assert (remote / "runs").is_dir() and (remote / "files" / "md5").is_dir()

    b = tmp_path / "b"
    subprocess.run(["git", "clone", "-q", str(a), str(b)], check=True)
    assert not (b / "dvc.lock").exists() and git(a, "rev-parse", "HEAD") == git(b, "rev-parse", "HEAD")
    started = time.monotonic()
    out = _dvc(b, env, "repro", "--pull")
    seconds = time.monotonic() - started
    log.warning("clone B: dvc repro --pull took %.1f s", seconds)  # shown with -rA / in the report
    assert "Running stage" not in out, out
    assert out.count("is cached - skipping run") + out.count("Restored stage") == 9, out
    assert "Data and pipelines are up to date." in _dvc(b, env, "status")
    shown = [json.loads(_dvc(clone, env, "metrics", "show", "--json")) for clone in (a, b)]
    assert shown[0] == shown[1] and "metrics/tiny/evaluate.json" in json.dumps(shown[0])
    assert (b / "runs" / "tiny" / "model" / "averaged.pt").read_bytes() == \
        (a / "runs" / "tiny" / "model" / "averaged.pt").read_bytes()
    assert not (b / "runs" / "tiny" / "train").exists()  # checkpoints stay where they were trained
    assert seconds < 60
