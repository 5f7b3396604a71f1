"""The training stage: one process vs two (gloo) processes, crash + resume, bad runs stop cleanly.

Shards are written with pyarrow in the encode stage's shard schema (pipeline/data/shard_writer.py) (a copy task on random ids), the BPE
model is a real tiny SentencePiece model (its piece count is the vocabulary size).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from pipeline.artifacts import checkpoint
from pipeline.core import stages
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.data.shard_reader import ShardSet
from tests.helpers.faultutil import tensors
from tests.helpers.paths import REPO
from tests.helpers.train import checkpoints, make_workspace, run_inprocess, run_torchrun, tiny_params


def load(folder: Path, name: str) -> dict:
    return torch.load(folder / name, weights_only=True)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_workspace(tmp_path_factory.mktemp("ws"))


def _stop_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The lines that say why training stopped or paused (caplog set to INFO for the loop first)."""
    messages = [r.getMessage() for r in caplog.records]
    return [m for m in messages if m.startswith(("training stopped", "training paused"))]


def test_single_process_run_writes_checkpoints_metrics_and_plots(workspace, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pipeline.training.loop")
    data = tiny_params(tmp_path, workspace)
    metrics = run_inprocess(data, tmp_path)
    assert _stop_lines(caplog) == ["training stopped: reached train.max_steps=6 at step 6"]
    steps = [s for s, _ in checkpoint.complete_checkpoints(checkpoints(tmp_path))]
    assert steps == [2, 4, 6]
    state = json.loads((checkpoints(tmp_path) / "step-00000006" / "state.json").read_text())
    assert state["step"] == 6 and state["world_size"] == 1 and state["config"]["model"]["vocab_size"] == 60
    sd = load(checkpoints(tmp_path) / "step-00000006", "model.pt")
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in sd)
    written = json.loads((tmp_path / "metrics" / "train.details.json").read_text())
    assert written["step"] == 6 and written == json.loads(json.dumps(metrics))
    assert written["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert written["machine"]["threads"] == torch.get_num_threads() and written["machine"]["cpu"]
    numbers = json.loads((tmp_path / "metrics" / "train.json").read_text())  # DVC metrics: the table's keys
    assert numbers == stages.summary("train", written) == {"step": 6, "tokens_seen": written["tokens_seen"]}
    lines = (tmp_path / "plots" / "train.csv").read_text().splitlines()
    assert lines[0].startswith("step,epoch,train_loss") and len(lines) == 7
    assert metrics["valid_loss"] > 0 and np.isfinite(metrics["train_ppl"])


def _rel_close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-6) -> bool:
    return bool((a - b).abs().max() <= rtol * max(a.abs().max().item(), b.abs().max().item(), 1e-30))


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_with_a_smaller_budget(workspace, tmp_path, monkeypatch):
    """dropout 0: 2 ranks (one forward pass each) and 1 process (NMT_MAX_TOKENS=40: several passes)
    train the same global batches; the first step's gradients (Adam's exp_avg / (1 - beta1), and
    exp_avg_sq) agree to 1e-6. Later steps start from weights that differ where a gradient is
    rounding noise around 0 (the key projection's bias, which softmax ignores: Adam's first step is
    ±lr either way), so only their batches are compared."""
    no_dropout = {"dropout": 0.0, "attn_dropout": 0.0, "ffn_dropout": 0.0}
    one, two = tmp_path / "one", tmp_path / "two"
    data1 = tiny_params(one, workspace, max_steps=2, warmup_steps=1, save_every_steps=1)
    data1["model"].update(no_dropout)
    monkeypatch.setenv("NMT_MAX_TOKENS", "40")
    metrics = run_inprocess(data1, one)
    monkeypatch.delenv("NMT_MAX_TOKENS")
    assert metrics["forwards_per_step_mean"] > 2 and metrics["max_tokens"] == 40
    data2 = tiny_params(two, workspace, max_steps=2, warmup_steps=1, save_every_steps=1)
    data2["model"].update(no_dropout)
    proc = run_torchrun(data2, two, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training on 2 process(es)" in proc.stderr and "DistributedDataParallel over 2 ranks" in proc.stderr
    assert json.loads((two / "metrics" / "train.details.json").read_text())["forwards_per_step_max"] == 1
    for step in (1, 2):
        a, b = (checkpoints(d) / f"step-{step:08d}" for d in (one, two))
        grads_a, grads_b = load(a, "optim.pt")["state"], load(b, "optim.pt")["state"]
        assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
        for k in grads_a if step == 1 else ():
            assert _rel_close(grads_a[k]["exp_avg"], grads_b[k]["exp_avg"]), (step, k)
            assert _rel_close(grads_a[k]["exp_avg_sq"], grads_b[k]["exp_avg_sq"]), (step, k)
        sa, sb = (json.loads((d / "state.json").read_text()) for d in (a, b))
        assert sa["tokens_seen"] == sb["tokens_seen"] and sa["position"] == sb["position"]


@pytest.mark.slow
def test_two_ranks_with_several_passes_each_equal_one_process(workspace, tmp_path):
    """NMT_MAX_TOKENS=40 on both: each of the 2 ranks accumulates several passes under DDP's no_sync() and sums
    over ranks in its last one; the first step's gradients (Adam's moments) equal one process's to 1e-6."""
    no_dropout = {"dropout": 0.0, "attn_dropout": 0.0, "ffn_dropout": 0.0}
    runs = {}
    for nproc in (1, 2):
        data = tiny_params(tmp_path / str(nproc), workspace, max_steps=2, warmup_steps=1, save_every_steps=1)
        data["model"].update(no_dropout)
        proc = run_torchrun(data, tmp_path / str(nproc), nproc=nproc, env={"NMT_MAX_TOKENS": "40"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        details = json.loads((tmp_path / str(nproc) / "metrics" / "train.details.json").read_text())
        assert details["forwards_per_step_max"] > 1, details
        runs[nproc] = load(checkpoints(tmp_path / str(nproc)) / "step-00000001", "optim.pt")["state"]
    assert "DistributedDataParallel over 2 ranks" in proc.stderr
    assert runs[1].keys() == runs[2].keys() and len(runs[1]) > 5
    for k in runs[1]:
        assert _rel_close(runs[1][k]["exp_avg"], runs[2][k]["exp_avg"]), k
        assert _rel_close(runs[1][k]["exp_avg_sq"], runs[2][k]["exp_avg_sq"]), k


@pytest.mark.slow
def test_sigkill_and_relaunch_ends_bitwise_equal_to_an_uninterrupted_run(workspace, tmp_path):
    """dropout on, 2 gloo ranks, 10 steps over two epochs; killed after step 5 (newest checkpoint: 4)."""
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    proc = run_torchrun(tiny_params(ref, workspace, max_steps=10), ref, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch.compile (NMT_COMPILE)" not in proc.stderr  # off unless asked for (test_compile.py: on)
    data = tiny_params(crash, workspace, max_steps=10)
    proc = run_torchrun(data, crash, nproc=2, env={"NMT_FAULT_POINT": "after_step:5"})
    assert proc.returncode != 0
    assert [s for s, _ in checkpoint.complete_checkpoints(checkpoints(crash))] == [2, 4]
    one = _check_world_size_change(data, crash, tmp_path / "one")
    # The staging folder of a save whose writer died, holding garbage: never loaded, deleted on relaunch.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    bogus = checkpoints(crash) / f".step-00000006.{dead}.abcd1234.tmp"
    (bogus / "step-00000006").mkdir(parents=True)
    (bogus / "step-00000006" / "model.pt").write_bytes(b"not a checkpoint")
    (bogus / ".nmt-temporary").write_text(json.dumps({"owner": f"{socket.gethostname()}/{dead}/",
                                                      "for": "step-00000006"}))
    proc = run_torchrun(data, crash, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr and "step-00000004" in proc.stderr
    assert not bogus.exists() and f"{bogus.name}, left behind by an interrupted run" in proc.stderr
    assert not (checkpoints(crash) / "step-00000006" / "model.pt").read_bytes().startswith(b"not")
    final_ref, final_crash = checkpoints(ref) / "step-00000010", checkpoints(crash) / "step-00000010"
    for name in ("model.pt", "optim.pt"):
        a, b = load(final_ref, name), load(final_crash, name)
        flat_a, flat_b = tensors(a), tensors(b)
        assert flat_a.keys() == flat_b.keys()
        assert all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), name
    sa, sb = (json.loads((d / "state.json").read_text()) for d in (final_ref, final_crash))
    assert sa["epoch"] == sb["epoch"] == 1 and sa["history"] == sb["history"]
    assert (ref / "plots" / "train.csv").read_bytes() == (crash / "plots" / "train.csv").read_bytes()
    # Resumed on 1 process: the same global batches, step by step (logged every step).
    sizes = [[(h["step"], h["tgt_tokens_per_step"]) for h in json.loads((d / "state.json").read_text())["history"]
              if "tgt_tokens_per_step" in h] for d in (final_ref, checkpoints(one) / "step-00000010")]
    assert len(sizes[0]) == 10 and sizes[0] == sizes[1]


def _check_world_size_change(data: dict, crashed: Path, tmp: Path) -> None:
    """A copy of the crashed 2-rank run resumed by one process (with a smaller per-forward budget):
    allowed, with a warning, and it trains the same global batches as the uninterrupted 2-rank run
    (the same target tokens in every step, logged each step)."""
    import logging

    shutil.copytree(crashed, tmp)
    data = json.loads(json.dumps(data).replace(str(crashed), str(tmp)))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("pipeline.training").addHandler(handler)
    os.environ["NMT_MAX_TOKENS"] = "40"
    try:
        metrics = run_inprocess(data, tmp)  # one process, several forward passes per step
    finally:
        logging.getLogger("pipeline.training").removeHandler(handler)
        del os.environ["NMT_MAX_TOKENS"]
    assert metrics["resumed_from_step"] == 4 and metrics["world_size"] == 1 and metrics["step"] == 10
    assert metrics["forwards_per_step_max"] > 1
    assert any("no longer bitwise equal" in r for r in records)
    return tmp


def test_another_config_trains_in_its_own_folder_and_leaves_the_first_byte_identical(workspace, tmp_path):
    """What ``dvc exp run -S train.lr_scale=3`` does in a built workspace: train from scratch in
    ``<paths.train>/<its digest>``; a run that changes only where training stops resumes in the first folder."""
    run_inprocess(tiny_params(tmp_path, workspace, max_steps=4), tmp_path)
    first = checkpoints(tmp_path)
    before = {p: p.read_bytes() for p in first.rglob("*") if p.is_file()}
    changed = tiny_params(tmp_path, workspace, max_steps=4, lr_scale=3.0)
    changed["model"]["d_ff"] = 48
    assert run_inprocess(changed, tmp_path)["resumed_from_step"] is None
    assert checkpoints(tmp_path) != first and checkpoints(tmp_path).parent == first.parent
    assert {p: p.read_bytes() for p in first.rglob("*") if p.is_file()} == before
    assert run_inprocess(tiny_params(tmp_path, workspace, max_steps=6), tmp_path)["resumed_from_step"] == 4
    assert checkpoints(tmp_path) == first


def test_more_steps_continue_the_same_run(workspace, tmp_path):
    run_inprocess(tiny_params(tmp_path, workspace, max_steps=4), tmp_path)
    metrics = run_inprocess(tiny_params(tmp_path, workspace, max_steps=8), tmp_path)
    assert metrics["resumed_from_step"] == 4 and metrics["step"] == 8 and metrics["epoch"] == 1
    rows = (tmp_path / "plots" / "train.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(1, 9))  # no gap, no duplicate


def test_non_finite_loss_stops_before_the_optimizer_step(workspace, tmp_path):
    data = tiny_params(tmp_path, workspace, max_steps=6, lr_scale=1e36, save_every_steps=1)
    with pytest.raises(PipelineError, match=r"train step (\d+): non-finite .*the optimizer step was not taken\. "
                                            r"Lower train.lr_scale, set train.clip_norm"):
        run_inprocess(data, tmp_path)
    steps = [s for s, _ in checkpoint.complete_checkpoints(checkpoints(tmp_path))]
    last = checkpoint.load_tensors(checkpoints(tmp_path) / f"step-{steps[-1]:08d}", "model.pt")
    assert all(torch.isfinite(t).all() for t in last.values())  # the bad update was never applied
    assert not (tmp_path / "metrics" / "train.json").exists()


def test_clip_norm_bounds_the_update(workspace, tmp_path):
    metrics = run_inprocess(tiny_params(tmp_path, workspace, max_steps=2, warmup_steps=1, clip_norm=1e-3), tmp_path)
    assert metrics["step"] == 2


def test_launch_builds_torchrun_commands_from_the_environment(monkeypatch):
    from pipeline.training import torchrun

    monkeypatch.setenv("NMT_NPROC", "4")
    monkeypatch.setenv("NMT_MAX_RESTARTS", "0")  # else --max-restarts=3 on a CUDA machine
    cmd = torchrun.torchrun_command(["--params", "p.yaml"])
    # torchrun --standalone, with every store on loopback (test_launch_security.py checks the sockets)
    assert cmd[1:] == ["-m", "pipeline.launch", "--torchrun", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
                       "--rdzv_id=nmt-train", "--local_addr=127.0.0.1", "--nnodes=1", "--nproc_per_node=4",
                       "-m", "pipeline.train", "--params", "p.yaml"]
    monkeypatch.setenv("NMT_NNODES", "2")
    monkeypatch.setenv("NMT_RDZV_ENDPOINT", "10.0.0.1:29400")
    assert "--rdzv_endpoint=10.0.0.1:29400" in torchrun.torchrun_command([])
    monkeypatch.setenv("NMT_NODE_RANK", "1")
    assert "--node_rank=1" in torchrun.torchrun_command([]) and "--master_addr=10.0.0.1" in torchrun.torchrun_command([])
    monkeypatch.setenv("NMT_NPROC", "zero")
    with pytest.raises(PipelineError, match=r"NMT_NPROC='zero': expected a whole number"):
        torchrun.torchrun_command([])


@pytest.mark.slow
def test_mlflow_run_is_continued_on_resume(workspace, tmp_path, mlflow_sqlite):
    from mlflow.tracking import MlflowClient

    first = run_inprocess(tiny_params(tmp_path, workspace, max_steps=4), tmp_path)
    second = run_inprocess(tiny_params(tmp_path, workspace, max_steps=6), tmp_path)
    assert first["mlflow_run_id"] and second["mlflow_run_id"] == first["mlflow_run_id"]
    client = MlflowClient(mlflow_sqlite)
    run = client.get_run(first["mlflow_run_id"])
    assert run.data.params["train.tokens_per_step"] == "192" and run.data.params["model.vocab_size"] == "60"
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "train/ppl", "train/lr", "train/grad_norm", "speed/tgt_tokens_per_s",
                "batch/tgt_tokens_per_step"):  # grouped as MLflow's UI groups charts: curves first
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == list(range(1, 7)), key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "valid/loss")] == [3, 4, 6]


def test_an_epoch_limit_ends_the_run(workspace, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pipeline.training.loop")
    metrics = run_inprocess(tiny_params(tmp_path, workspace, max_steps=100, valid_every_steps=50, max_epochs=1),
                            tmp_path)
    steps = metrics["global_batches"]  # one epoch = one step per global batch
    assert _stop_lines(caplog) == [f"training stopped: reached train.max_epochs=1 at step {steps}"]
    assert metrics["step"] == steps and metrics["epoch"] == 1 and 4 <= steps <= 8
    assert checkpoint.latest(checkpoints(tmp_path)).name == f"step-{steps:08d}"
    state = json.loads((checkpoint.latest(checkpoints(tmp_path)) / "state.json").read_text(encoding="utf-8"))
    _, src_len, tgt_len = ShardSet(workspace["shards"], "train").lengths()  # one epoch: every pair once
    assert (state["src_tokens_seen"], state["tokens_seen"]) == (int((src_len + 1).sum()), int((tgt_len + 1).sum()))
    assert metrics["src_tokens_per_step_mean"] == state["src_tokens_seen"] / steps


def test_max_minutes_pauses_keeps_checkpoints_and_the_rerun_resumes(workspace, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pipeline.training.loop")
    with pytest.raises(PipelineError, match=r"train.max_minutes \(1e-06\) reached at step 1 of train.max_steps \(3\)"
                                            r": checkpoints kept in .*; run the train stage again"):
        run_inprocess(tiny_params(tmp_path, workspace, max_steps=3, max_minutes=1e-6), tmp_path)
    assert _stop_lines(caplog) == ["training paused: train.max_minutes=1e-06 used up at step 1 of "
                                   "train.max_steps=3; rerun the stage to resume"]
    assert checkpoint.latest(checkpoints(tmp_path)).name == "step-00000001"
    assert not (tmp_path / "metrics" / "train.json").exists()  # nothing for DVC to record
    caplog.clear()
    metrics = run_inprocess(tiny_params(tmp_path, workspace, max_steps=3), tmp_path)
    assert metrics["resumed_from_step"] == 1 and metrics["step"] == 3
    assert _stop_lines(caplog) == ["training stopped: reached train.max_steps=3 at step 3"]
    caplog.clear()
    run_inprocess(tiny_params(tmp_path, workspace, max_steps=3), tmp_path)  # nothing left to train
    assert _stop_lines(caplog) == ["training stopped: reached train.max_steps=3 at step 3"]


def test_a_restart_of_a_paused_torchrun_job_pauses_again(workspace, tmp_path, monkeypatch):
    """torchrun --max-restarts restarts a group whose worker failed: the same job must not train on."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    with pytest.raises(PipelineError, match="max_minutes"):
        run_inprocess(tiny_params(tmp_path, workspace, max_steps=3, max_minutes=1e-6), tmp_path)
    with pytest.raises(PipelineError, match="max_minutes"):  # the agent's restart: no step trained
        run_inprocess(tiny_params(tmp_path, workspace, max_steps=3, max_minutes=1e-6), tmp_path)
    assert checkpoint.latest(checkpoints(tmp_path)).name == "step-00000001"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")  # a new launch resumes
    assert run_inprocess(tiny_params(tmp_path, workspace, max_steps=3), tmp_path)["step"] == 3
    assert not (checkpoints(tmp_path) / "PAUSED").exists()


def test_nmt_max_tokens_below_the_longest_pair_is_refused(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("NMT_MAX_TOKENS", "8")
    with pytest.raises(PipelineError, match=r"NMT_MAX_TOKENS=8: training pair id \d+ alone needs \d+ padded tokens "
                                            r"per forward pass; set NMT_MAX_TOKENS >= \d+"):
        run_inprocess(tiny_params(tmp_path, workspace, max_steps=3), tmp_path)


def test_train_max_tokens_in_params_names_the_variable(workspace, tmp_path):
    from pipeline.core.config import params_from_dict

    data = tiny_params(tmp_path, workspace)
    data["train"]["max_tokens"] = 4096
    with pytest.raises(PipelineError, match=r"train.max_tokens: moved to the environment variable NMT_MAX_TOKENS"):
        params_from_dict(data)
    done = run_torchrun(data, tmp_path, nproc=1)  # what `dvc repro train` prints: one line
    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"error: stage train: {tmp_path / 'params.yaml'}: train.max_tokens: moved to the environment variable "
        "NMT_MAX_TOKENS (hardware, not a result-changing param); delete the key"], done.stderr


def test_a_params_error_is_one_line_before_torchrun_starts(workspace, tmp_path):
    data = tiny_params(tmp_path, workspace)
    data["train"]["lr_scale"] = -1.0
    done = run_torchrun(data, tmp_path, nproc=1)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [f"error: stage train: {tmp_path / 'params.yaml'}: train.lr_scale: -1.0 is out "
                                        "of range (expected > 0)"], done.stderr
    assert not (tmp_path / "runs").exists()


def test_a_model_this_machine_cannot_hold_is_one_line_naming_the_model_keys_before_torchrun(workspace, tmp_path):
    """``model.d_ff`` huge but under MAX_WEIGHTS died allocating its weights, naming no key; the weights, gradients
    and Adam's moments are now checked against the machine's available memory before torchrun starts."""
    import re

    from pipeline.core.config import params_from_dict

    data = tiny_params(tmp_path, workspace)
    data["model"].update(d_model=16, d_ff=60_000_000, n_layers=1)
    p = params_from_dict(data)
    count = p.model.weight_count(p.bpe.vocab_size)
    available = psutil.virtual_memory().available
    if count * 16 <= available:
        pytest.skip("this machine could hold the model")
    done = run_torchrun(data, tmp_path, nproc=1)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert re.fullmatch(
        rf"error: stage train: model.d_model 16, model.d_ff 60000000, model.n_layers 1 and bpe.vocab_size "
        rf"{p.bpe.vocab_size} make {re.escape(f'{count:.2e}')} weights: {count * 16 / 2**30:.1f} GiB for fp32 "
        r"weights, gradients and "
        r"Adam's moments before any activation, more than the \d+\.\d GiB of the available memory \(psutil\) for each "
        r"of 1 training process\(es\); lower model.d_ff or model.d_model\n", done.stderr), done.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_failed_rank_ends_the_job_with_its_error_and_one_line_instead_of_torchruns_traceback(workspace, tmp_path):
    """The rank's own line, then one line naming the rank; no ChildFailedError traceback or failure table."""
    done = run_torchrun(tiny_params(tmp_path, workspace, max_steps=3, max_minutes=1e-6), tmp_path, nproc=1)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].endswith("training failed: rank 0 ended with exit code 1 (its error is above)"), done.stderr
    assert any(line.startswith("error: stage train: train.max_minutes (1e-06) reached at step 1") for line in lines)
    assert checkpoint.latest(checkpoints(tmp_path)).name == "step-00000001"  # the pause kept its checkpoint


def test_a_resumed_run_logs_the_same_interval_losses_as_an_uninterrupted_one(workspace, tmp_path):
    """The interval average spans the resume: the line at step 6 covers steps 4-6 either way."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_inprocess(tiny_params(whole, workspace, max_steps=6, log_every_steps=3, valid_every_steps=10), whole)
    run_inprocess(tiny_params(split, workspace, max_steps=4, log_every_steps=3, valid_every_steps=10), split)
    run_inprocess(tiny_params(split, workspace, max_steps=6, log_every_steps=3, valid_every_steps=10), split)

    def lines(folder: Path) -> list[tuple]:
        history = json.loads((checkpoints(folder) / "step-00000006" / "state.json").read_text())["history"]
        return [(h["step"], h["train_loss"], h["tgt_tokens_per_step"]) for h in history if "train_loss" in h]

    assert lines(whole) == lines(split) and [s for s, _, _ in lines(whole)] == [3, 6]


def test_nmt_device_cuda_without_cuda_is_one_line_before_torchrun_starts(workspace, tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA (test_more_processes_than_gpus_is_one_line_naming_nmt_nproc covers it)")
    expected = ("environment: NMT_DEVICE=cuda: this torch build sees no CUDA device (torch.cuda.is_available() is "
                "False); set NMT_DEVICE=cpu or unset it")
    done = run_torchrun(tiny_params(tmp_path, workspace), tmp_path, nproc=1, env={"NMT_DEVICE": "cuda"})
    assert done.returncode == 1 and done.stderr.splitlines() == [f"error: stage train: {expected}"], done.stderr
    assert not (tmp_path / "runs").exists()
    from pipeline.training import distributed

    with pytest.raises(ConfigError) as info:  # `python -m pipeline.train` alone: refused where the device is set
        distributed.init("cuda")
    assert str(info.value) == expected


@pytest.mark.gpu
def test_more_processes_than_gpus_is_one_line_naming_nmt_nproc(monkeypatch):
    from pipeline.training import distributed

    n = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(n))
    with pytest.raises(ConfigError) as info:
        distributed.init("cuda")
    assert str(info.value) == (f"environment: local rank {n} needs cuda:{n}, but this machine has {n} CUDA "
                               f"device(s); set NMT_NPROC <= {n}")


def _rewritten_shards(workspace: dict[str, Path], tmp_path: Path, change: str, *, record: bool) -> tuple[dict, Path]:
    """A copy of the workspace whose first train shard is rewritten (``record``: its new sha256 put in the
    manifest too, as a consistent rewrite would)."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = Path(shutil.copytree(workspace["shards"], tmp_path / "shards"))
    part = shards / "train" / "part-00000.parquet"
    table = pq.read_table(part)
    if change == "string ids":
        table = table.set_column(0, "id", pa.array([str(i) for i in table.column("id").to_pylist()]))
    elif change == "all zeros":
        zeros = pa.array([[0] * len(r) for r in table.column("src").to_pylist()], table.schema.field("src").type)
        table = table.set_column(1, "src", zeros)
    elif change == "empty targets":
        empty = pa.array([[] for _ in range(table.num_rows)], table.schema.field("tgt").type)
        table = table.set_column(2, "tgt", empty).set_column(4, "tgt_len", pa.array([0] * table.num_rows, pa.int32()))
    else:  # ids beyond the 60-piece vocabulary
        tgt = table.column("tgt")
        beyond = pa.array([[60 + t for t in r] for r in tgt.to_pylist()], tgt.type)
        table = table.set_column(2, "tgt", beyond)
    pq.write_table(table, part)
    if record:
        manifest = json.loads((shards / "manifest.json").read_text())
        manifest["splits"]["train"]["shards"][0]["sha256"] = hashlib.sha256(part.read_bytes()).hexdigest()
        (shards / "manifest.json").write_text(json.dumps(manifest))
    return {**workspace, "shards": shards}, part


@pytest.mark.parametrize("change", ["string ids", "all zeros", "empty targets", "ids beyond the vocabulary"])
def test_a_shard_rewritten_after_encode_is_refused_before_the_first_step(workspace, tmp_path, change):
    ws, part = _rewritten_shards(workspace, tmp_path, change, record=False)
    with pytest.raises(PipelineError) as info:
        run_inprocess(tiny_params(tmp_path, ws, max_steps=3), tmp_path)
    assert str(info.value) == (f"{part}: content does not match the sha256 in {ws['shards'] / 'manifest.json'} "
                               "(rewritten or damaged after encode); rerun `dvc repro encode`")
    assert checkpoint.latest(checkpoints(tmp_path)) is None


@pytest.mark.parametrize(("change", "message"), [
    ("ids beyond the vocabulary", "column 'tgt' holds token id \\d+, beyond the vocabulary of 60 in "),
    ("string ids", "column 'id' is string, not what the encode stage writes; "),
])
def test_bad_ids_under_a_matching_manifest_are_one_line_naming_the_shard(workspace, tmp_path, change, message):
    ws, part = _rewritten_shards(workspace, tmp_path, change, record=True)
    with pytest.raises(PipelineError, match=rf"^{part}: {message}.*rerun `dvc repro encode`$"):
        run_inprocess(tiny_params(tmp_path, ws, max_steps=3), tmp_path)
