"""A sweep variant's clone (``flows/sweep_work.py``) after its ``dvc exp run`` was killed: the rerun in the same
clone skips the stages the killed run had built, as a failed run's rerun does (``test_sweep_toy.py``)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from flows.dvc_task import stage_status
from flows.sweep_work import cache_dir, exp_run_command, head_commit, prepare_clone, sweep_dir
from tests.helpers.toyflow import MakeRepo

pytestmark = pytest.mark.slow


def test_a_killed_experiment_leaves_its_built_stages_to_the_rerun(make_repo: MakeRepo, tmp_path: Path) -> None:
    """``fit`` SIGKILLs its whole process group (``dvc exp run`` with it) while ``marker`` exists, after ``prep``
    was built: what a killed sweep does to its variants. DVC had staged dvc.lock in the clone's git index."""
    marker = tmp_path / "kill"
    marker.write_text("")
    kill = f"python -c \"import os, signal; os.path.exists('{marker}') and os.killpg(0, signal.SIGKILL)\""
    repo = make_repo({"prep": {"cmd": "python toy.py write prep.txt", "deps": ["toy.py"], "outs": ["prep.txt"]},
                      "fit": {"cmd": f"{kill} && python toy.py write fit.txt prep.txt", "deps": ["toy.py", "prep.txt"],
                              "params": ["train"], "outs": ["fit.txt"]}})
    commit, cache = head_commit(repo), cache_dir(repo)
    clone = prepare_clone(repo, sweep_dir(repo, "s") / "s-1", commit, cache)
    command = exp_run_command("s-1", {"train.warmup_steps": 13})
    killed = subprocess.run(command, cwd=clone, capture_output=True, text=True, timeout=120, start_new_session=True,
                            check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert list(yaml.safe_load((clone / "dvc.lock").read_text(encoding="utf-8"))["stages"]) == ["prep"]

    marker.unlink()
    prepare_clone(repo, clone, commit, cache)  # the sweep's restart
    assert list(yaml.safe_load((clone / "dvc.lock").read_text(encoding="utf-8"))["stages"]) == ["prep"]
    again = subprocess.run(command, cwd=clone, capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    lines = again.stdout.splitlines()
    assert (stage_status("prep", lines), stage_status("fit", lines)) == ("skipped", "ran"), again.stdout


def test_a_clone_reads_the_checkouts_mirror_beside_it_unless_nmt_data_mirror_says_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clone under .dvc/tmp/sweeps has no ../shared/data beside it: an offline `nmt sweep` tried the network."""
    from flows.sweep import SweepContext

    checkout, shared = tmp_path / "work" / "checkout", tmp_path / "work" / "shared" / "data"
    checkout.mkdir(parents=True)
    ctx = SweepContext(root=str(checkout), sweep="s", profile="tiny", commit="c", cache="", base_clone=None,
                       parent_run_id=None, flow_run_id="f", grace_s=1.0)
    monkeypatch.delenv("NMT_DATA_MIRROR", raising=False)
    assert "NMT_DATA_MIRROR" not in ctx.env(None)  # no mirror anywhere: upstream, as in the checkout
    shared.mkdir(parents=True)
    assert ctx.env(None)["NMT_DATA_MIRROR"] == str(shared)
    monkeypatch.setenv("NMT_DATA_MIRROR", "")  # set but empty: none, in the clone too
    assert ctx.env(None)["NMT_DATA_MIRROR"] == ""
