"""``NMT_DETERMINISTIC``: deterministic kernels, and what they buy on a GPU (a killed and resumed run
ends bitwise equal to an uninterrupted one: docs/training.md, "On a GPU").

On the CPU the switch must change nothing (CPU kernels are deterministic for a fixed thread count);
the CUDA test is skipped without a GPU and runs in ``benchmarks/gpu.py check`` on a device.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.artifacts import checkpoint
from tests.helpers.faultutil import tensors
from tests.helpers.train import checkpoints, make_workspace, run_torchrun, tiny_params

LINE = "deterministic kernels (NMT_DETERMINISTIC): on"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_workspace(tmp_path_factory.mktemp("ws"))


def _final(folder: Path, step: int) -> dict[str, torch.Tensor]:
    last = checkpoints(folder) / f"step-{step:08d}"
    return {name: tensors(torch.load(last / name, weights_only=True)) for name in ("model.pt", "optim.pt")}


def _bitwise_equal(a: dict, b: dict) -> bool:
    return all(a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a)


def _killed_and_resumed(workspace: dict, tmp: Path, env: dict, steps: int) -> Path:
    """Killed after step 5 (newest checkpoint: 4), then relaunched to ``steps``."""
    data = tiny_params(tmp, workspace, max_steps=steps)
    proc = run_torchrun(data, tmp, nproc=1, env={**env, "NMT_FAULT_POINT": "after_step:5"})
    assert proc.returncode != 0
    assert [s for s, _ in checkpoint.complete_checkpoints(checkpoints(tmp))][-1] == 4
    proc = run_torchrun(data, tmp, nproc=1, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr
    return tmp


@pytest.mark.slow
def test_the_switch_changes_nothing_on_the_cpu(workspace, tmp_path):
    plain, det = tmp_path / "plain", tmp_path / "det"
    for folder, env in ((plain, {}), (det, {"NMT_DETERMINISTIC": "1"})):
        proc = run_torchrun(tiny_params(folder, workspace, max_steps=4), folder, nproc=1, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (LINE in proc.stderr) == bool(env), proc.stderr[-3000:]
    assert _bitwise_equal(_final(plain, 4), _final(det, 4))


@pytest.mark.gpu
@pytest.mark.slow
def test_with_deterministic_kernels_a_killed_and_resumed_cuda_run_is_bitwise_equal(workspace, tmp_path):
    """One NCCL process on CUDA, dropout on, 10 steps, killed and resumed vs uninterrupted."""
    env = {"NMT_DEVICE": "cuda", "NMT_DETERMINISTIC": "1", "NMT_MAX_RESTARTS": "0"}
    ref = tmp_path / "ref"
    proc = run_torchrun(tiny_params(ref, workspace, max_steps=10), ref, nproc=1, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert LINE in proc.stderr and "nccl" in proc.stderr
    resumed = _killed_and_resumed(workspace, tmp_path / "resumed", env, steps=10)
    assert _bitwise_equal(_final(ref, 10), _final(resumed, 10))
    history = [json.loads((checkpoints(d) / "step-00000010" / "state.json").read_text())["history"]
               for d in (ref, resumed)]
    assert history[0] == history[1]
