"""One process with a fused Adam (CUDA's) steps without reading the device: figures are read at log, validation
and save steps. Here the CPU gets a fused Adam too (``setup.FUSED_ADAM``), so the path runs without a GPU, and
each run is compared with the same run read after every step (``loop.on_device`` off). The ``gpu`` cases run
the same comparisons on CUDA."""

from __future__ import annotations

import pytest
import torch

from pipeline.artifacts import checkpoint
from pipeline.core.errors import PipelineError
from pipeline.training import loop, setup
from tests.helpers.train import checkpoints, make_workspace, run_inprocess, tiny_params


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return make_workspace(tmp_path_factory.mktemp("ws"))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def fused_adam(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU with a fused Adam patched in, or CUDA's own (deterministic kernels, so two runs can be compared)."""
    monkeypatch.setenv("NMT_DEVICE", request.param)
    if request.param == "cpu":
        monkeypatch.setattr(setup, "FUSED_ADAM", ("cuda", "cpu"))
    else:
        monkeypatch.setenv("NMT_DETERMINISTIC", "1")


REAL_SETTLE, REAL_ON_DEVICE = loop.settle, loop.on_device


def _run(data: dict, tmp, monkeypatch: pytest.MonkeyPatch, *, read_every_step: bool):
    """Train ``data``; the result and the steps each read settled (a list per read)."""
    reads: list[list[int]] = []
    monkeypatch.setattr(loop, "settle", lambda steps: (reads.append([s for s, _ in steps]), REAL_SETTLE(steps))[1])
    monkeypatch.setattr(loop, "on_device", (lambda tr: False) if read_every_step else REAL_ON_DEVICE)
    return run_inprocess(data, tmp), reads


def test_steps_read_at_log_points_train_bitwise_as_steps_read_every_step(workspace, tmp_path, monkeypatch,
                                                                          fused_adam):
    params = dict(max_steps=7, log_every_steps=3, valid_every_steps=5, save_every_steps=7)
    lazy, lazy_reads = _run(tiny_params(tmp_path / "a", workspace, **params), tmp_path / "a", monkeypatch,
                            read_every_step=False)
    eager, _ = _run(tiny_params(tmp_path / "b", workspace, **params), tmp_path / "b", monkeypatch,
                    read_every_step=True)
    assert [r for r in lazy_reads if r] == [[1, 2, 3], [4, 5], [6], [7]]  # log 3, 6; valid 5; save 7 (the end)
    assert (tmp_path / "a" / "plots" / "train.csv").read_text() == (tmp_path / "b" / "plots" / "train.csv").read_text()
    a, b = (checkpoint.load_tensors(checkpoints(tmp_path / x) / "step-00000007", "model.pt") for x in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert lazy["tokens_per_step_mean"] == eager["tokens_per_step_mean"] and lazy["valid_ppl"] == eager["valid_ppl"]


def test_a_non_finite_step_read_late_names_the_same_step_and_saves_nothing_after_it(workspace, tmp_path,
                                                                                     monkeypatch, fused_adam):
    params = dict(max_steps=9, lr_scale=1e36, log_every_steps=3, valid_every_steps=9, save_every_steps=3)
    found = []
    for name, every in (("lazy", False), ("eager", True)):
        with pytest.raises(PipelineError, match=r"train step (\d+): non-finite .*the optimizer step was not taken"
                           ) as err:
            _run(tiny_params(tmp_path / name, workspace, **params), tmp_path / name, monkeypatch,
                 read_every_step=every)
        bad = int(str(err.value).split(":")[0].split()[-1])
        found.append(bad)
        for step, folder in checkpoint.complete_checkpoints(checkpoints(tmp_path / name)):
            assert step < bad
            model = checkpoint.load_tensors(folder, "model.pt")
            assert all(torch.isfinite(t).all() for t in model.values())
    assert found[0] == found[1]
