"""Training survives faults: kills at named points and at a random time, a crashed or hung rank, OOM, bad files.

Real processes throughout: torchrun with two gloo CPU ranks, faults injected through
``NMT_FAULT_POINT`` (pipeline/faults.py). Recovery is judged bitwise against one uninterrupted
2-rank run (checkpoint of the last step: weights, Adam state, history; the plots file).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.artifacts import checkpoint
from pipeline.core.config import checkpoint_folder, params_from_dict
from pipeline.core.errors import CheckpointError, ConfigError, PipelineError
from pipeline.core.owned import claim_folder
from pipeline.data import batching
from pipeline.training import faults, preflight, torchrun
from tests.helpers import faultutil as fu
from tests.helpers.train import checkpoints, make_workspace, run_inprocess, tiny_params

MAX_STEPS = 10


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_workspace(tmp_path_factory.mktemp("ws"))


def job_params(tmp: Path, ws: dict[str, Path], **train) -> dict:
    """2 ranks, several forward passes each per step (NMT_MAX_TOKENS=96 in fu.job_env): 10 steps span
    several epochs."""
    return tiny_params(tmp, ws, **({"max_steps": MAX_STEPS, "tokens_per_step": 384, "keep_last": 2,
                                    "valid_every_steps": 5} | train))


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 2-rank run."""
    tmp = tmp_path_factory.mktemp("reference")
    rc, out = fu.run(job_params(tmp, workspace), tmp)
    assert rc == 0, out[-3000:]
    assert "forward passes of <= 96 padded tokens" in out and fu.steps(checkpoints(tmp)) == [8, 10]
    return tmp


def _crash(data: dict, tmp: Path, point: str) -> str:
    rc, out = fu.run(data, tmp, env={"NMT_FAULT_POINT": point})
    assert rc != 0 and f"NMT_FAULT_POINT={point}:kill" in out, out[-3000:]
    return out


@pytest.mark.slow
def test_kills_at_every_named_point_resume_bitwise_equal(workspace, reference, tmp_path):
    data = job_params(tmp_path, workspace)
    runs = checkpoint_folder(params_from_dict(data))
    _crash(data, tmp_path, "before_save:2")
    assert fu.steps(runs) == [] and not list(runs.glob(".step-*"))
    out = _crash(data, tmp_path, "mid_save:4")  # from scratch; dies inside checkpoint 4's write
    assert "resuming from" not in out and fu.steps(runs) == [2]
    (half,) = runs.glob(".step-00000004.*.tmp")
    assert sorted(p.name for p in (half / "step-00000004").iterdir()) == ["model.pt"]  # no optim.pt, state, DONE
    out = _crash(data, tmp_path, "after_save:6")  # DONE written, not yet pruned
    assert "resuming from" in out and "step-00000002" in out and f"{half.name}, left behind by an interrupted run" in out
    assert not half.exists() and fu.steps(runs) == [2, 4, 6]
    out = _crash(data, tmp_path, "mid_accum:7")  # between two forward passes of step 7
    assert "step-00000006 (step 6, epoch " in out and fu.steps(runs) == [4, 6]  # pruning finished
    rc, out = fu.run(data, tmp_path)
    assert rc == 0 and "resuming from" in out and "step-00000006" in out, out[-3000:]
    assert fu.steps(runs) == [8, 10]
    fu.assert_bitwise_equal(reference, tmp_path, MAX_STEPS)
    assert json.loads((tmp_path / "metrics" / "train.details.json").read_text())["resumed_from_step"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("seed", [20260521])
def test_process_group_killed_at_a_seeded_random_time(workspace, reference, tmp_path, seed):
    """SIGKILL of torchrun's whole process group (its ranks die with it) some time after the first checkpoint."""
    delay = random.Random(seed).uniform(0.0, 1.5)
    data = job_params(tmp_path, workspace, save_every_steps=1)  # a checkpoint write most of the time
    job = fu.start(data, tmp_path)
    assert fu.wait_for(lambda: fu.steps(checkpoints(tmp_path)) or job.poll() is not None, 90), "no checkpoint"
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):  # (the job may have finished already)
        os.killpg(job.pid, signal.SIGKILL)
    fu.finish(job)
    assert fu.wait_for(lambda: not fu.workers_of(tmp_path / "params.yaml"), 10), "orphaned ranks survived"
    killed_at = fu.steps(checkpoints(tmp_path))
    rc, out = fu.run(data, tmp_path)
    assert rc == 0, out[-3000:]
    assert f"step-{killed_at[-1]:08d}" in out and not list((checkpoints(tmp_path)).glob(".step-*"))
    fu.assert_bitwise_equal(reference, tmp_path, MAX_STEPS)


@pytest.mark.slow
def test_a_rank_crashing_once_is_restarted_by_torchrun(workspace, reference, tmp_path):
    marker = tmp_path / "crashed-once"
    env = {"NMT_FAULT_POINT": f"after_step:5:exit:1@{marker}", "NMT_MAX_RESTARTS": "1"}
    rc, out = fu.run(job_params(tmp_path, workspace), tmp_path, env=env)
    assert rc == 0, out[-3000:]
    assert marker.exists() and "exit 3" in out and "resuming from" in out and "step-00000004" in out
    fu.assert_bitwise_equal(reference, tmp_path, MAX_STEPS)


@pytest.mark.slow
def test_a_hung_rank_times_out_with_the_env_var_named_and_the_restart_resumes(workspace, reference, tmp_path):
    marker = tmp_path / "stalled-once"
    env = {"NMT_FAULT_POINT": f"collective:7:stall:1@{marker}", "NMT_MAX_RESTARTS": "1",
           "NMT_DIST_TIMEOUT_S": "8"}
    start = time.monotonic()
    rc, out = fu.run(job_params(tmp_path, workspace), tmp_path, env=env, timeout=150)
    assert rc == 0, out[-3000:]
    assert "error: stage train: rank 0: collective all_reduce_sum timed out after 8 s (NMT_DIST_TIMEOUT_S)" in out
    assert "resuming from" in out and "step-00000006" in out and marker.exists()
    assert time.monotonic() - start < 120
    fu.assert_bitwise_equal(reference, tmp_path, MAX_STEPS)


def test_out_of_memory_at_preflight_names_max_tokens_and_the_shape(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("NMT_FAULT_POINT", "preflight:0:oom")
    monkeypatch.setenv("NMT_MAX_TOKENS", "96")
    with pytest.raises(PipelineError) as err:
        run_inprocess(tiny_params(tmp_path, workspace), tmp_path)
    msg = str(err.value)
    assert msg.startswith("pre-flight on cpu: one forward+backward of the largest forward-pass shape (")
    assert "NMT_MAX_TOKENS=96) ran out of memory. Set NMT_MAX_TOKENS lower" in msg and "injected" in msg
    assert "trains the same global batch" in msg
    assert not (tmp_path / "runs").exists() and not (tmp_path / "metrics").exists()


def test_preflight_shapes_are_the_plans_largest():
    rng = np.random.default_rng(3)
    ids = np.arange(500) * 2
    lengths = rng.integers(2, 60, 500)
    plan = batching.plan_global_batches(ids, lengths, lengths, tokens_per_step=900, seed=1)
    real = batching.forward_shapes(plan, rank=1, world_size=2, max_tokens=200)
    shapes = preflight.largest_shapes(real)
    pos = {int(i): int(n) for i, n in zip(ids, lengths)}
    passes = [p for b in plan for p in batching.forward_passes(b, rank=1, world_size=2, max_tokens=200)]
    assert real == [(len(p), max(pos[int(i)] for i in p)) for p in passes]
    assert shapes[0] == max(real, key=lambda s: (s[0] * s[1], s[1])) and shapes[0][0] * shapes[0][1] <= 200
    assert shapes[-1] == max(real, key=lambda s: (s[0] * s[1] ** 2, s[0]))


def test_an_out_of_memory_step_is_skipped_and_counted(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("NMT_FAULT_POINT", f"forward:3:oom@{tmp_path / 'oom-once'}")
    metrics = run_inprocess(tiny_params(tmp_path, workspace), tmp_path)
    assert metrics["step"] == 6 and metrics["oom_skipped_steps"] == 1
    assert checkpoint.read_state(checkpoints(tmp_path) / "step-00000006")["oom_skipped"] == 1


def test_repeated_out_of_memory_stops_with_the_shape_and_max_tokens(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("NMT_FAULT_POINT", "forward:3:oom")  # no @<file>: step 3 fails every time it is tried
    with pytest.raises(PipelineError, match=r"train step 3: 3 optimizer steps in a row ran out of memory \(last: "
                                            r"rank 0, forward pass \d+: src \[\d+, \d+\], tgt \[\d+, \d+\]\) .*"
                                            r"set NMT_MAX_TOKENS lower and rerun"):
        run_inprocess(tiny_params(tmp_path, workspace), tmp_path)
    assert fu.steps(checkpoints(tmp_path)) == [2] and not (tmp_path / "metrics" / "train.json").exists()


@pytest.mark.slow
def test_out_of_memory_on_one_rank_skips_the_step_on_both(workspace, tmp_path):
    env = {"NMT_FAULT_POINT": f"forward:3:oom:1@{tmp_path / 'oom-once'}"}
    rc, out = fu.run(job_params(tmp_path, workspace, max_steps=4), tmp_path, env=env)
    assert rc == 0, out[-3000:]
    assert "train step 3: out of memory (rank 1, forward pass" in out
    metrics = json.loads((tmp_path / "metrics" / "train.details.json").read_text())
    assert metrics["step"] == 4 and metrics["oom_skipped_steps"] == 1


def test_truncated_checkpoint_file_is_named_with_the_remedy(workspace, tmp_path):
    run_inprocess(tiny_params(tmp_path, workspace, max_steps=4), tmp_path)
    model = checkpoints(tmp_path) / "step-00000004" / "model.pt"
    size = model.stat().st_size
    model.write_bytes(model.read_bytes()[:size // 2])
    before = sorted(str(p) for p in (checkpoints(tmp_path)).rglob("*"))
    with pytest.raises(CheckpointError) as err:
        run_inprocess(tiny_params(tmp_path, workspace, max_steps=6), tmp_path)
    assert str(err.value) == (
        f"{model}: truncated ({size // 2} of the {size} bytes written; a full disk or an interrupted copy?); "
        f"delete the folder {model.parent} (or move it away) and rerun to resume from step-00000002")
    assert sorted(str(p) for p in (checkpoints(tmp_path)).rglob("*")) == before
    shutil.rmtree(model.parent)
    metrics = run_inprocess(tiny_params(tmp_path, workspace, max_steps=6), tmp_path)
    assert metrics["resumed_from_step"] == 2 and metrics["step"] == 6


def test_fault_specs_and_restart_counts_are_checked(monkeypatch):
    monkeypatch.setenv("NMT_FAULT_POINT", "mid_sav:4")
    with pytest.raises(ConfigError, match=r"NMT_FAULT_POINT='mid_sav:4': unknown point 'mid_sav'; one of preflight"):
        faults.active()
    monkeypatch.setenv("NMT_FAULT_POINT", "forward:x:explode")
    with pytest.raises(ConfigError, match=r"(?s)unknown action 'explode'.*step 'x' is not a non-negative integer"):
        faults.active()
    monkeypatch.setenv("NMT_FAULT_POINT", "collective:3:stall:1")
    assert faults.active() == faults.Fault("collective", 3, "stall", 1)
    monkeypatch.setenv("NMT_FAULT_POINT", "after_step:5")
    assert faults.active() == faults.Fault("after_step", 5, "kill")
    monkeypatch.setenv("NMT_MAX_RESTARTS", "2")
    assert "--max-restarts=2" in torchrun.torchrun_command([])
    monkeypatch.setenv("NMT_MAX_RESTARTS", "0")
    assert not any(a.startswith("--max-restarts") for a in torchrun.torchrun_command([]))
    monkeypatch.setenv("NMT_MAX_RESTARTS", "-1")
    with pytest.raises(ConfigError, match=r"NMT_MAX_RESTARTS='-1': Input should be greater than or equal to 0"):
        torchrun.torchrun_command([])


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_at_preflight_is_named_and_freed():
    import torch

    from model import Transformer, TransformerConfig

    dev = torch.device("cuda")
    model = Transformer(TransformerConfig(vocab_size=32000, d_model=256, n_heads=4, d_ff=1024, n_layers=1)).to(dev)
    base = torch.cuda.memory_allocated(dev)
    with pytest.raises(PipelineError, match=r"\(4096 sentences x 1024 tokens, NMT_MAX_TOKENS=4194304\) ran out of "
                                            r"memory\. Set NMT_MAX_TOKENS lower"):
        preflight.check(model, [(4096, 1024)], device=dev, max_tokens=4096 * 1024, label_smoothing=0.1)
    assert torch.cuda.memory_allocated(dev) <= base + (64 << 20)  # nothing of the failed attempt is kept
    preflight.check(model, [(8, 64)], device=dev, max_tokens=512, label_smoothing=0.1)  # the next shape fits
    assert all(p.grad is None for p in model.parameters())


def _dvc_train_repo(tmp: Path, ws: dict[str, Path], then: str = "", **train) -> Path:
    """A git + DVC repo at ``tmp`` whose stage ``train`` runs the launcher on ``tmp/params.yaml`` (1 CPU rank), and
    ``then`` after it in the same shell command."""
    import subprocess

    import yaml

    from tests.helpers.repoutil import init_git_dvc

    init_git_dvc(tmp)
    fu.write_params(tiny_params(tmp, ws, **train), tmp)
    (tmp / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {
        "cmd": f"python -m pipeline.launch --params {tmp / 'params.yaml'}{then}", "params": ["train"]}}}),
        encoding="utf-8")
    subprocess.run(["git", "add", "-A"], cwd=tmp, check=True, capture_output=True)
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("then", ["", " && echo trained"], ids=["shell-execs", "shell-waits"])
def test_sigkill_of_dvc_repro_alone_ends_the_training_it_started(workspace, tmp_path, then):
    """`kill -9` of the dvc process only (not its group): the agent sees dvc gone (pidfd) and stops itself and its
    rank as SIGTERM does, within seconds; nothing trains on in the folder (parent pid 1). DVC runs the command
    through ``$SHELL -c``, which either becomes the launcher (one command) or waits for it (``&& ...``)."""
    import subprocess

    from tests.helpers.paths import REPO

    repo = _dvc_train_repo(tmp_path / "repo", workspace, then, max_steps=100000, save_every_steps=1000)
    params = repo / "params.yaml"
    env = {**fu.job_env(1), "PYTHONPATH": str(REPO)}
    log = tmp_path / "dvc.log"
    with log.open("w") as out:
        dvc = subprocess.Popen(["dvc", "repro", "train"], cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        assert fu.wait_for(lambda: len(fu.workers_of(params)) >= 2, 90), log.read_text()  # the agent and its rank
        time.sleep(3)  # the rank is training
        assert dvc.poll() is None, log.read_text()
        os.kill(dvc.pid, signal.SIGKILL)
        dvc.wait()
        assert fu.wait_for(lambda: not fu.workers_of(params), 15), \
            f"training outlived dvc: {fu.workers_of(params)}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(dvc.pid, signal.SIGKILL)


def test_a_second_trainer_on_a_held_training_folder_is_one_line(workspace, tmp_path):
    """The launcher holds .<digest>.nmt-train.lock beside its training folder <paths.train>/<digest> for the whole
    run; a second one on the folder is refused before torchrun starts, naming the lock and the pid holding it; the
    folder is not made."""
    from tests.helpers.lockholder import hold_lock

    data = job_params(tmp_path, workspace)
    runs = checkpoint_folder(params_from_dict(data))
    lock = runs.parent / f".{runs.name}.nmt-train.lock"
    claim_folder(runs.parent, checkpoint.ROLE)  # paths.train, as the first run of any config leaves it
    holder = hold_lock(runs.parent, "training into runs", lock=Path(lock.name))
    try:
        rc, out = fu.run(data, tmp_path, nproc=1)
        lines = [line for line in out.splitlines() if "error" in line.lower()]
        assert rc == 1 and lines == [
            f"error: stage train: {lock}: another run holds it (pid {holder.pid}, since "
            f"{out.split('since ')[1].split(',')[0]}, training into runs); two trainers must not write one folder "
            f"({runs}): wait for it to end or stop it, then run the stage again"], out
        assert not runs.exists() and not fu.workers_of(tmp_path / "params.yaml")
    finally:
        holder.communicate("", timeout=30)
