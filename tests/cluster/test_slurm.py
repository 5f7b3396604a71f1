"""The train stage under a real Slurm (tests/cluster/conftest.py: slurmctld and two slurmd on 127.0.0.1): the
whole pipeline submitted as one job (``sbatch --wrap "dvc repro"``) trains through cluster/slurm/train.sbatch, one
srun task per node, each torchrun meeting the other at the first node, then averages and evaluates; and the job
script submitted on its own trains, after which ``dvc commit`` records it and DVC goes on from there. Each starts
from a copy of the built project with another seed: a training config neither DVC's run cache nor a checkpoint
folder knows, so train really runs (on the same config DVC restores it: every stage is in the run cache)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import checkpoint_folder, load_params
from tests.helpers.nodes import free_port
from tests.helpers.paths import REPO
from tests.helpers.tinyproject import built_env, copy_built

pytestmark = pytest.mark.slow

#: The job's wall-clock limit here: the tiny profile trains in well under a minute a node.
JOB_TIMEOUT_S = 900


def project(tiny_built: Path, dest: Path) -> Path:
    """A copy of the built tiny project with cluster/ (the job script) and ``seed`` one more in params.yaml: a new
    training config, so the next ``dvc repro`` trains again (in a new checkpoint folder, nothing to resume)."""
    repo = copy_built(tiny_built, dest)
    shutil.copytree(REPO / "cluster", repo / "cluster")
    params = yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8"))
    params["seed"] += 1
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    assert not (repo / checkpoint_folder(load_params(repo / "params.yaml"))).exists()
    return repo


def job_env(slurm: dict[str, str], tiny_built: Path, port: int) -> dict[str, str]:
    """What the submitting shell exports (sbatch passes it to the job): this interpreter's bin first, the built
    project's stage environment, the rendezvous port."""
    return {**slurm, **built_env(tiny_built), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "RDZV_PORT": str(port)}


def sbatch(repo: Path, environ: dict[str, str], *args: str) -> str:
    """``sbatch --wait ARGS`` in ``repo``; the job's output (stdout and stderr), asserting it exited 0."""
    log = repo / "job.out"
    done = subprocess.run(["sbatch", "--wait", "--nodes=2", f"--output={log}", *args], cwd=repo, env=environ,
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S, check=False)
    out = log.read_text(encoding="utf-8") if log.is_file() else ""
    assert done.returncode == 0, done.stdout + done.stderr + out[-4000:]
    return out


def trained_steps(repo: Path) -> int:
    """The step of the newest checkpoint in the training folder of ``repo``'s params.yaml
    (:func:`pipeline.core.config.checkpoint_folder`)."""
    folder = repo / checkpoint_folder(load_params(repo / "params.yaml"))
    return max(int(p.name.split("-")[1]) for p in folder.glob("step-*"))


def details(repo: Path, stage: str) -> dict:
    """``metrics/tiny/<stage>.details.json``."""
    return json.loads((repo / "metrics" / "tiny" / f"{stage}.details.json").read_text(encoding="utf-8"))


def locked_stages(repo: Path) -> set[str]:
    """The stages dvc.lock records."""
    return set(yaml.safe_load((repo / "dvc.lock").read_text(encoding="utf-8"))["stages"])


def test_the_whole_pipeline_as_one_job_trains_on_both_nodes_then_averages_and_evaluates(
        slurm: dict[str, str], tiny_built: Path, tmp_path: Path) -> None:
    repo = project(tiny_built, tmp_path / "project")
    out = sbatch(repo, job_env(slurm, tiny_built, free_port()), "--wrap", "dvc repro evaluate")
    for stage in ("train", "average", "evaluate"):
        assert f"Running stage '{stage}'" in out, out[-4000:]
    assert "node 0 of 2" in out and "node 1 of 2" in out, out[-4000:]
    assert details(repo, "train")["world_size"] == 2
    assert trained_steps(repo) == details(tiny_built / "project", "train")["step"]
    assert details(repo, "evaluate") and {"train", "average", "evaluate"} <= locked_stages(repo)
    status = subprocess.run(["dvc", "status", "evaluate"], cwd=repo, env=job_env(slurm, tiny_built, 0),
                            capture_output=True, text=True, timeout=120, check=True)
    assert "up to date" in status.stdout, status.stdout


def test_the_job_script_alone_trains_and_dvc_commit_lets_the_pipeline_go_on(
        slurm: dict[str, str], tiny_built: Path, tmp_path: Path) -> None:
    repo = project(tiny_built, tmp_path / "project")
    environ = job_env(slurm, tiny_built, free_port())
    out = sbatch(repo, environ, "cluster/slurm/train.sbatch")
    assert "node 0 of 2" in out and "node 1 of 2" in out, out[-4000:]
    assert trained_steps(repo) == details(tiny_built / "project", "train")["step"]
    assert details(repo, "train")["world_size"] == 2
    subprocess.run(["dvc", "commit", "-f", "train"], cwd=repo, env=environ, capture_output=True, text=True,
                   timeout=120, check=True)
    done = subprocess.run(["dvc", "repro", "evaluate"], cwd=repo, env=environ, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Stage 'train' didn't change, skipping" in done.stdout, done.stdout
    assert "Running stage 'average'" in done.stdout and "Running stage 'evaluate'" in done.stdout, done.stdout
