"""``benchmarks/gpu.py check``: the GPU code paths end to end, the CUDA tests, bf16 against fp32 and determinism,
one ``step_*`` function each (described in benchmarks/gpu.py)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, write_params
from benchmarks.gpu_steps.runner import Runner, params_for, step_throughput
from pipeline.core.config import checkpoint_folder, load_params
from pipeline.training.curves import read_history

GPU_TESTS = ("tests/model/test_cuda.py", "tests/pipeline/training/test_deterministic_kernels.py",
             "tests/pipeline/training/test_train.py", "tests/pipeline/training/test_faults_train.py",
             "tests/pipeline/inference/test_translate.py", "tests/pipeline/training/test_loop_on_device.py")


def steps(r: Runner, data: Path, profiles: list[str], modes: list[str], dry: bool) -> dict[str, tuple[Any, float]]:
    """The ``check`` steps in order, each with the seconds it needs on the device (a guess from past runs)."""
    one, big = profiles
    return {"tiny": (lambda: step_profile(r, data, "tiny", one, "train", dry), 60),
            "demo": (lambda: step_profile(r, data, "demo", big, "launch", dry), 120),
            "pytest": (lambda: step_pytest(r, dry), 150),
            "precision": (lambda: step_precision(r, data, big, dry), 90),
            "determinism": (lambda: step_determinism(r, data, big, dry, tuple(modes)), 120),
            "throughput": (lambda: step_throughput(r, dry), 60)}


def step_pytest(r: Runner, dry: bool) -> dict[str, Any]:
    """``pytest -m gpu`` on :data:`GPU_TESTS` (all skipped without CUDA); its last line is the summary."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-m", "gpu", *GPU_TESTS]
    done = r.cmd("pytest", argv, timeout=min(60 if dry else 300, max(r.left(), 30)))
    tail = (r.work / "logs" / "pytest.log").read_text(encoding="utf-8").splitlines()[-1:]
    return {**done, "summary": tail[0] if tail else ""}


def step_profile(r: Runner, data: Path, step: str, profile: str, launcher: str, dry: bool) -> dict[str, Any]:
    """train (or ``launch``) -> average -> evaluate on ``profile`` in ``work/<step>``."""
    work = r.work / step
    train = {"max_steps": 6, "warmup_steps": 2, "save_every_steps": 2, "valid_every_steps": 3,
             "log_every_steps": 1} if dry else {}
    params = params_for(profile, data, work, **train)
    if dry:
        params["evaluate"].update(beam_sizes=[1], alphas=[0.6], max_len_b=5)
    write_params(params, work)
    return r.chain(step, work, timeout=max(min(r.left(), 900), 60), launcher=launcher, NMT_NPROC="1")


def step_precision(r: Runner, data: Path, profile: str, dry: bool) -> dict[str, Any]:
    """``profile`` (demo) for 200 steps (warm-up 100) in bf16 (the product) and fp32; loss at every 10th step."""
    steps = 6 if dry else 200
    train = {"max_steps": steps, "warmup_steps": steps // 2, "save_every_steps": steps,
             "valid_every_steps": max(steps // 4, 1), "log_every_steps": 2 if dry else 10}
    out: dict[str, Any] = {}
    curves = {}
    fp32 = [str(REPO / "benchmarks" / "gpu.py"), "fp32-train"]  # the train stage with autocast off
    for name, argv in (("bf16", ["-m", "pipeline.train"]), ("fp32", fp32)):
        work = r.work / f"precision-{name}"
        path = write_params(params_for(profile, data, work, **train), work)
        out[name] = r.cmd(f"precision-{name}", [sys.executable, *argv, "--params", str(path)], 300)
        if out[name]["rc"] != 0:
            return out
        curves[name] = [{k: v for k, v in row.items() if v is not None}  # train.csv without its empty cells
                        for row in read_history(work / "plots" / "train.csv")]
    return {**out, "curves": curves, "compare": compare_curves(curves["bf16"], curves["fp32"])}


def compare_curves(a: list[dict[str, float]], b: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Largest absolute and relative difference of each loss column, over the steps both logged."""
    by_step = {row["step"]: row for row in b}
    worst: dict[str, dict[str, float]] = {}
    for column in ("train_loss", "train_nll", "valid_loss", "valid_nll"):
        pairs = [(row[column], by_step[row["step"]][column]) for row in a
                 if column in row and row["step"] in by_step and column in by_step[row["step"]]]
        if pairs:
            worst[column] = {"points": len(pairs), "max_abs": max(abs(x - y) for x, y in pairs),
                             "max_rel": max(abs(x - y) / abs(y) for x, y in pairs)}
    return worst


def step_determinism(r: Runner, data: Path, profile: str, dry: bool,
                     only: tuple[str, ...] = ("default", "deterministic")) -> dict[str, Any]:
    """Two runs and one killed after step ``kill`` and relaunched, per mode in ``only``. A dry run checks the
    script with the first mode and without the second run (CPU training is deterministic, and
    tests/pipeline/training/test_faults_train.py compares resumed runs bitwise)."""
    steps, every, kill = (6, 2, 3) if dry else (40, 10, 21)
    train = {"max_steps": steps, "warmup_steps": steps // 2, "save_every_steps": every, "valid_every_steps": steps,
             "log_every_steps": every}
    out: dict[str, Any] = {}
    modes = [(m, e) for m, e in (("default", {}), ("deterministic", {"NMT_DETERMINISTIC": "1"})) if m in only]
    for mode, extra in modes[:1] if dry else modes:
        runs: dict[str, Path] = {}
        for run in ("a", "resumed") if dry else ("a", "b", "resumed"):
            work = r.work / f"det-{mode}-{run}"
            path = write_params(params_for(profile, data, work, **train), work)
            if run == "resumed":
                r.stage(f"det-{mode}-{run}-killed", "launch", path, NMT_FAULT_POINT=f"after_step:{kill}", **extra)
            done = r.stage(f"det-{mode}-{run}", "launch", path, **extra)
            if done["rc"] != 0:
                out[mode] = {"failed": f"det-{mode}-{run}", **done}
                break
            runs[run] = checkpoint_folder(load_params(path)) / f"step-{steps:08d}"
        else:
            out[mode] = {f"a_vs_{run}": compare_checkpoints(runs["a"], runs[run]) for run in runs if run != "a"}
        r.save("determinism", out)
    return out


def compare_checkpoints(a: Path, b: Path) -> dict[str, Any]:
    """Bitwise equality and the largest absolute difference of the weights and of Adam's state."""
    import torch

    def flat(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
        if isinstance(obj, torch.Tensor):
            return {prefix: obj}
        if isinstance(obj, dict):
            return {k: v for key, val in obj.items() for k, v in flat(val, f"{prefix}.{key}").items()}
        return {}

    result: dict[str, Any] = {}
    for name in ("model.pt", "optim.pt"):
        x, y = (flat(torch.load(d / name, map_location="cpu", weights_only=True)) for d in (a, b))
        floats = [k for k in x if x[k].is_floating_point()]
        result[name] = {"bitwise_equal": all(torch.equal(x[k], y[k]) for k in x),
                        "max_abs_diff": max(float((x[k].double() - y[k].double()).abs().max()) for k in floats)}
    history_a, history_b = (json.loads((d / "state.json").read_text(encoding="utf-8"))["history"] for d in (a, b))
    return {**result, "history_equal": history_a == history_b}


def fp32_train(params: Path) -> int:
    """The train stage with autocast off: the fp32 reference for the bf16 curves."""
    import torch

    from pipeline import train
    from pipeline.training import loop, preflight

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    loop.autocast = preflight.autocast = lambda device: contextlib.nullcontext()
    return train.main(["--params", str(params)])
