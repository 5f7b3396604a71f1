"""A sweep variant's ``dvc exp run --temp`` (``flows/sweep_work.py``) on the toy pipeline: killed, its rerun restores
the stages the killed run had built from the run cache; its stages find the checkout's ``../shared/data`` though
they run in DVC's temporary workspace."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from flows.dvc_task import stage_status
from flows.sweep_work import exp_ref, exp_run_command, head_commit, read_at
from tests.helpers.paths import REPO
from tests.helpers.toyflow import MakeRepo

pytestmark = pytest.mark.slow


def test_a_killed_experiment_leaves_its_built_stages_to_the_rerun(make_repo: MakeRepo, tmp_path: Path) -> None:
    """``fit`` SIGKILLs its whole process group (``dvc exp run`` with it) while ``marker`` exists, after ``prep``
    was built: what a killed sweep does to its variants. DVC's temporary workspace is gone; its run cache is not."""
    marker = tmp_path / "kill"
    marker.write_text("")
    kill = f"python -c \"import os, signal; os.path.exists('{marker}') and os.killpg(0, signal.SIGKILL)\""
    repo = make_repo({"prep": {"cmd": "python toy.py write prep.txt", "deps": ["toy.py"], "outs": ["prep.txt"]},
                      "fit": {"cmd": f"{kill} && python toy.py write fit.txt prep.txt", "deps": ["toy.py", "prep.txt"],
                              "params": ["train"], "outs": ["fit.txt"]}})
    command = exp_run_command("s-1", {"train.warmup_steps": 13})
    killed = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=120, start_new_session=True,
                            check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert "Running stage 'prep'" in killed.stdout and exp_ref(repo, "s-1", head_commit(repo)) is None

    marker.unlink()
    again = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    lines = again.stdout.splitlines()
    assert (stage_status("prep", lines), stage_status("fit", lines)) == ("restored", "ran"), again.stdout
    rev = exp_ref(repo, "s-1", head_commit(repo))
    assert rev and read_at(repo, rev, "fit.txt") == "xx"  # from the experiment, through DVC's cache


def test_a_variants_stages_read_the_checkouts_mirror_beside_it(make_repo: MakeRepo, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """DVC's temporary workspace under .dvc/tmp/exps has no ../shared/data beside it; the stage finds the
    checkout's (pipeline/core/env.py, data_mirror) unless NMT_DATA_MIRROR says otherwise."""
    show = (f"python -c \"import sys; sys.path.insert(0, '{REPO}'); from pathlib import Path; "
            "from pipeline.core.env import data_mirror; "
            "open('mirror.txt', 'w').write(str(data_mirror(Path.cwd()).location))\"")
    repo = make_repo({"look": {"cmd": show, "deps": ["toy.py"], "params": ["train"], "outs": ["mirror.txt"]}})
    shared = repo.parent / "shared" / "data"
    shared.mkdir(parents=True)
    monkeypatch.delenv("NMT_DATA_MIRROR", raising=False)
    for name, setting in (("m-1", None), ("m-2", "")):
        if setting is not None:
            monkeypatch.setenv("NMT_DATA_MIRROR", setting)
        done = subprocess.run(exp_run_command(name, {"train.warmup_steps": len(name) + int(name[-1])}), cwd=repo,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    commit = head_commit(repo)
    assert read_at(repo, exp_ref(repo, "m-1", commit) or "", "mirror.txt") == str(shared.resolve())
    assert read_at(repo, exp_ref(repo, "m-2", commit) or "", "mirror.txt") == "None"  # set but empty: none
