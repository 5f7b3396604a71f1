"""``dvc exp run -S <a training param>`` in a built workspace, as DVC users run it: the experiment trains from scratch
in a checkpoint folder of its own (``<paths.train>/<digest>``, pipeline/core/config.py) and never refuses or touches
the workspace's checkpoints."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import checkpoint_folder, load_params
from tests.helpers.tinyproject import built_env, copy_built

pytestmark = pytest.mark.slow


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_experiment_on_a_training_param_trains_in_its_own_folder(tiny_built: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    repo = copy_built(tiny_built, tmp_path / "project")
    for name, value in built_env(tiny_built).items():
        monkeypatch.setenv(name, value)
    ours = checkpoint_folder(load_params(repo / "params.yaml"))
    before = _files(repo / ours)
    assert before
    done = subprocess.run(["dvc", "exp", "run", "-n", "warm8", "-S", "train.warmup_steps=8"], cwd=repo,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Running stage 'train'" in done.stdout and "Running stage 'download'" not in done.stdout
    params = yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8"))
    assert params["train"]["warmup_steps"] == 8  # the experiment's params stay in the workspace, as DVC leaves them
    theirs = checkpoint_folder(load_params(repo / "params.yaml"))
    assert theirs != ours and theirs.parent == ours.parent and (repo / theirs / "step-00000020" / "DONE").is_file()
    assert _files(repo / ours) == before  # the workspace's checkpoints, byte for byte
    details = json.loads((repo / params["paths"]["metrics"] / "train.details.json").read_text(encoding="utf-8"))
    assert details["resumed_from_step"] is None and details["folder"] == str(theirs)
    shown = subprocess.run(["dvc", "exp", "show", "--json"], cwd=repo, capture_output=True, text=True, timeout=120,
                           check=True).stdout
    assert "warm8" in shown
