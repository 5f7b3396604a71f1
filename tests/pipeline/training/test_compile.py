"""``NMT_COMPILE``: the training forward pass and loss under ``torch.compile`` (dynamic shapes) compute what the
eager function computes, for every batch shape and in validation, and a compiled run resumes bitwise.

Compiled on the CPU here (inductor's C++ backend); ``benchmarks/gpu.py check`` runs the CUDA path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from model import Transformer, TransformerConfig
from pipeline.training.forward import batch_loss, loss_function
from pipeline.training.preflight import check
from tests.helpers.faultutil import tensors
from pipeline.core.config import checkpoint_folder, params_from_dict
from tests.helpers.train import checkpoints, make_workspace, run_torchrun, tiny_params

LINE = "torch.compile (NMT_COMPILE): on; the first forward pass compiles"
NO_DROPOUT = {"dropout": 0.0, "attn_dropout": 0.0, "ffn_dropout": 0.0}


def _batch(gen: torch.Generator, n: int, length: int) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(4, 50, (3, n, length), generator=gen)
    ids[:, 0, length - 2:] = 0  # one padded row
    return ids[0].clone(), ids[1].clone(), ids[2].clone()  # not views: a guard on the view's base would recompile


def _model_config(data: dict, workspace: dict[str, Path]) -> TransformerConfig:
    """The model the train stage builds from ``data`` on the workspace's BPE model (its vocabulary)."""
    manifest = json.loads((workspace["shards"] / "manifest.json").read_text(encoding="utf-8"))
    return params_from_dict(data).model.with_vocab(manifest["vocab_size"])


@pytest.mark.slow
def test_the_compiled_loss_equals_the_eager_one_after_the_preflight_for_new_shapes_and_without_gradients(
        workspace, tmp_path) -> None:
    """The two-rank test's model (dropout 0): the pre-flight's graph it compiles here is the one that test's ranks
    compile in their pre-flight, which then finds it in inductor's cache."""
    torch.manual_seed(0)
    data = tiny_params(tmp_path, workspace)
    data["model"].update(NO_DROPOUT)
    model = Transformer(_model_config(data, workspace))
    compiled, gen = loss_function(True), torch.Generator().manual_seed(1)
    assert loss_function(False) is batch_loss
    check(model, [(4, 9)], device=torch.device("cpu"), max_tokens=36, label_smoothing=0.1, loss=compiled)
    for n, length in ((3, 7), (5, 11), (2, 4)):  # dynamic shapes: no recompile per shape, same numbers
        batch = _batch(gen, n, length)
        results = []
        for fn in (batch_loss, compiled):
            model.zero_grad(set_to_none=True)
            with torch._dynamo.config.patch(error_on_recompile=True):  # the pre-flight's graph serves every batch
                loss_sum, nll_sum = fn(model, *batch, 0.1)
            loss_sum.backward()
            results.append((loss_sum.detach(), nll_sum.detach(), [p.grad.clone() for p in model.parameters()]))
        (la, na, ga), (lb, nb, gb) = results
        torch.testing.assert_close((la, na), (lb, nb), rtol=1e-5, atol=1e-5)
        for a, b in zip(ga, gb):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        with torch.no_grad():
            torch.testing.assert_close(compiled(model, *batch, 0.1), batch_loss(model, *batch, 0.1))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_workspace(tmp_path_factory.mktemp("ws"))


def _state(folder: Path, step: int) -> tuple[dict, list]:
    last = checkpoints(folder) / f"step-{step:08d}"
    weights = {name: tensors(torch.load(last / name, weights_only=True)) for name in ("model.pt", "optim.pt")}
    return weights, json.loads((last / "state.json").read_text(encoding="utf-8"))["history"]


@pytest.mark.slow
def test_a_compiled_training_run_with_dropout_resumes_bitwise(workspace, tmp_path):
    """Training, validation and the pre-flight through the compiled function, dropout on (inductor draws the masks
    from the reseeded generator); a second run resumed from the first one's step-4 checkpoint ends as it did."""
    runs = {}
    for name in ("whole", "resumed"):
        data = tiny_params(tmp_path / name, workspace, max_steps=5, valid_every_steps=5)
        assert data["model"]["dropout"] > 0
        if name == "resumed":
            whole, resumed = checkpoints(tmp_path / "whole"), checkpoint_folder(params_from_dict(data))
            shutil.copytree(whole / "step-00000004", resumed / "step-00000004")
            for source, folder in ((whole, resumed), (whole.parent, resumed.parent)):  # training folders' markers
                shutil.copy(source / ".nmt-output", folder)
        proc = run_torchrun(data, tmp_path / name, nproc=1, env={"NMT_COMPILE": "on"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert LINE in proc.stderr, proc.stderr[-3000:]
        runs[name] = _state(tmp_path / name, 5)
    assert "resuming from" in proc.stderr and "step-00000004" in proc.stderr, proc.stderr[-3000:]
    (whole, whole_log), (resumed, resumed_log) = runs.values()
    for part in ("model.pt", "optim.pt"):
        assert whole[part].keys() == resumed[part].keys()
        assert all(torch.equal(whole[part][k], resumed[part][k]) for k in whole[part])
    assert whole_log == resumed_log and [h["step"] for h in whole_log if "valid_loss" in h] == [5]


@pytest.mark.slow
def test_a_compiled_two_rank_run_compiles_inside_ddp_and_matches_the_eager_one(workspace, tmp_path):
    """2 gloo ranks, dropout 0: the compiled pass is compiled inside DistributedDataParallel's forward (dynamo's
    DDPOptimizer logs its buckets) and its first step's gradients (Adam's moments) equal the eager run's to 1e-5."""
    moments = {}
    for name, extra in (("eager", {}), ("compiled", {"NMT_COMPILE": "on",
                                                       "TORCH_LOGS": "torch._dynamo.backends.distributed"})):
        data = tiny_params(tmp_path / name, workspace, max_steps=2, warmup_steps=1, save_every_steps=1)
        data["model"].update(NO_DROPOUT)
        proc = run_torchrun(data, tmp_path / name, nproc=2, env=extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "DistributedDataParallel over 2 ranks" in proc.stderr
        moments[name] = torch.load(checkpoints(tmp_path / name) / "step-00000001" / "optim.pt")["state"]
    assert LINE in proc.stderr and "DDPOptimizer used bucket cap 26214400" in proc.stderr, proc.stderr[-3000:]
    eager, compiled = moments["eager"], moments["compiled"]
    assert eager.keys() == compiled.keys() and len(eager) > 5
    for k in eager:
        for m in ("exp_avg", "exp_avg_sq"):
            a, b = eager[k][m], compiled[k][m]
            assert (a - b).abs().max() <= 1e-5 * max(a.abs().max().item(), 1e-30), (k, m)
