"""Which command the train stage's launcher runs with respect to Slurm (``python -m pipeline.launch --dry-run``):
inside an allocation but outside its steps, cluster/slurm/train.sbatch; inside a step (what that script's srun
starts) or outside Slurm, torchrun; a checkout without the script, one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

SCRIPT = REPO / "cluster" / "slurm" / "train.sbatch"


def dry_run(cwd: Path, **slurm: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | slurm | {"NMT_NPROC": "1"}
    return subprocess.run([sys.executable, "-m", "pipeline.launch", "--dry-run", "--params", "p.yaml"], cwd=cwd,
                          env=environ, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("slurm", "script"), [
    ({}, False), ({"SLURM_JOB_ID": "7"}, True), ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}, False)])
def test_the_job_script_runs_in_an_allocation_outside_its_steps(slurm: dict[str, str], script: bool) -> None:
    done = dry_run(REPO, **slurm)
    assert done.returncode == 0, done.stderr
    expected = f"/bin/bash {SCRIPT} --params p.yaml" if script else "-m pipeline.launch --torchrun"
    assert expected in done.stdout, done.stdout


def test_a_checkout_without_the_job_script_is_one_line(tmp_path: Path) -> None:
    for folder in ("pipeline", "model"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    done = dry_run(tmp_path, SLURM_JOB_ID="7")
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: stage train: SLURM_JOB_ID=7: training in a Slurm allocation runs "
        f"{tmp_path.resolve() / 'cluster/slurm/train.sbatch'}, which is missing; restore it from git"], done.stderr
