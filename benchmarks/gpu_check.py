"""The GPU code paths, run and checked on a CUDA machine in one command (and dry-run on a CPU by the tests).

    python benchmarks/gpu_check.py prepare --data data/gpu            # here, on CPU: tiny + demo data stages
    python benchmarks/gpu_check.py run --data data/gpu --out OUT      # on the GPU machine (carry data/gpu)
    python benchmarks/gpu_check.py run --data D --out O --dry-run     # CPU, a few steps (tests/benchmarks)

Figures from a device run are in benchmarks/RESULTS.md (GPU).

``run`` does these steps, each stage a subprocess with its own log (under ``--work``, default
/tmp/gpu_check) and a time limit, and rewrites ``OUT/gpu_check.json`` and ``OUT/logs.tar.gz`` (the logs
and loss curves) after every step, so what finished comes back even if a later step hangs:

- ``env``: torch, CUDA and the device.
- ``tiny``: ``python -m pipeline.train`` (one process) -> ``average`` -> ``evaluate``.
- ``demo``: ``python -m pipeline.launch`` (torchrun, one process, NCCL) -> ``average`` -> ``evaluate``.
- ``pytest``: the ``gpu``-marked tests (the rest of the suite needs MLflow, DVC and Prefect).
- ``precision``: 200 demo steps in bf16 autocast (what training does on CUDA) and in fp32 (autocast off,
  ``fp32-train``): train and valid loss at every logged step.
- ``determinism``: demo steps run twice, and killed + resumed, with and without ``NMT_DETERMINISTIC``:
  are the final weights and Adam moments bitwise equal, and if not, how far apart.
- ``attention``: beam searches over new shapes with the model's attention backends and with cuDNN's allowed
  (cuDNN builds a graph per new shape; :data:`model.layers.CUDA_ATTENTION`).
- ``throughput``: ``benchmarks/train.py --device cuda`` on the base model.

``--profiles A B`` picks the profiles (default ``tiny demo``): A for the one-process run, B for the torchrun
run, the precision and the determinism steps (the dry run in the tests uses ``tiny tiny``).

The stages run with MLflow tracking off (``NMT_TRACKING=off``): the device image has no MLflow. Other ``NMT_*``
variables pass through to them (``NMT_COMPILE=on python3 benchmarks/gpu_check.py run ... --steps demo``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.project.profiles import merged_profile  # noqa: E402
from pipeline.training.curves import read_history  # noqa: E402

log = logging.getLogger("gpu_check")
DATA_STAGES = ("download", "clean", "bpe", "encode")
DATA_PATHS = ("raw", "clean", "bpe", "shards")
RUN_PATHS = ("train", "model", "eval", "metrics", "plots", "reports")
GPU_TESTS = ("tests/model/test_cuda.py", "tests/pipeline/training/test_deterministic_kernels.py",
             "tests/pipeline/training/test_train.py", "tests/pipeline/training/test_faults_train.py",
             "tests/pipeline/inference/test_translate.py")


def params_for(profile: str, data: Path, work: Path | None, **train: Any) -> dict:
    """Profile ``profile``'s params: data paths under ``data/<profile>``, run paths under ``work``.

    ``data`` is relative to the repository (the params loader takes data/, runs/, ... inside the checkout)
    or absolute outside it; ``work`` is absolute, outside it.
    """
    params = merged_profile(profile, REPO)
    params["paths"].update({k: str(data / profile / k) for k in DATA_PATHS})
    if work is not None:
        params["paths"].update({k: str(work / k) for k in RUN_PATHS})
    params["train"].update(train)
    return params


def write_params(params: dict, folder: Path) -> Path:
    """``folder/params.yaml`` holding ``params``."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return path


class Runner:
    """Runs commands with a log file each, and keeps the results JSON up to date."""

    def __init__(self, out: Path, work: Path, device: str, results: str = "gpu_check.json") -> None:
        self.out, self.work, self.device, self.results_name = out, work, device, results
        (work / "logs").mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device}

    def env(self, **extra: str) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "NMT_TRACKING": "off", "NMT_DEVICE": self.device, "PYTHONPATH": path,
                "PYTHONUNBUFFERED": "1", "NMT_MAX_RESTARTS": "0", **extra}

    def cmd(self, name: str, argv: list[str], timeout: float, **extra: str) -> dict[str, Any]:
        """Run ``argv`` from the repository root; its output goes to ``logs/<name>.log``."""
        started = time.monotonic()
        with (self.work / "logs" / f"{name}.log").open("w", encoding="utf-8") as fh:
            try:
                rc = subprocess.run(argv, cwd=REPO, env=self.env(**extra), stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        done = {"rc": rc, "seconds": round(time.monotonic() - started, 2)}
        log.info("%-32s rc=%s %7.1f s", name, rc, done["seconds"])
        return done

    def stage(self, name: str, stage: str, params: Path, timeout: float = 300, **extra: str) -> dict[str, Any]:
        module = "pipeline.launch" if stage == "launch" else f"pipeline.{stage}"
        return self.cmd(name, [sys.executable, "-m", module, "--params", str(params)], timeout, **extra)

    def step(self, name: str, do: Callable[[], Any]) -> None:
        """Run one step and save what it returns, or its error (the next step's figures are worth having)."""
        started = time.monotonic()
        try:
            self.save(name, do())
        except Exception as exc:
            log.exception("step %s failed", name)
            self.save(name, {"error": repr(exc)})
        log.info("step %s: %.1f s", name, time.monotonic() - started)

    def save(self, step: str, value: Any) -> None:
        self.results[step] = value
        text = json.dumps(self.results, indent=1, default=str) + "\n"
        (self.out / self.results_name).write_text(text, encoding="utf-8")
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:  # few files come back from a device call
            tar.add(self.work / "logs", arcname="logs")
            for curve in sorted(self.work.glob("*/plots/train.csv")) + sorted(self.work.glob("*.json")):
                tar.add(curve, arcname=str(curve.relative_to(self.work)))


def step_env() -> dict[str, Any]:
    """torch, Python, the CUDA device and NCCL versions, ``nvidia-smi -L``."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", memory_gib=props.total_memory / 2**30,
                    sms=props.multi_processor_count, cuda=torch.version.cuda, devices=torch.cuda.device_count(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    smi = shutil.which("nvidia-smi")
    if smi:
        info["nvidia_smi"] = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.strip()
    return info


def step_pytest(r: Runner, dry: bool) -> dict[str, Any]:
    """``pytest -m gpu`` on :data:`GPU_TESTS` (all skipped without CUDA); its last line is the summary."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-m", "gpu", *GPU_TESTS]
    done = r.cmd("pytest", argv, timeout=60 if dry else 300)
    tail = (r.work / "logs" / "pytest.log").read_text(encoding="utf-8").splitlines()[-1:]
    return {**done, "summary": tail[0] if tail else ""}


def _metrics(work: Path) -> dict[str, Any]:
    """The headline figures the evaluate and train stages wrote (paths.metrics)."""
    found: dict[str, Any] = {}
    for path in sorted((work / "metrics").glob("*.json")):
        found[path.stem] = json.loads(path.read_text(encoding="utf-8"))
    return found


def step_profile(r: Runner, data: Path, profile: str, launcher: str, dry: bool) -> dict[str, Any]:
    """train -> average -> evaluate on ``profile``; ``launcher`` is ``train`` (one process) or ``launch``."""
    work = r.work / profile
    train = {"max_steps": 6, "warmup_steps": 2, "save_every_steps": 2, "valid_every_steps": 3,
             "log_every_steps": 1} if dry else {}
    params = params_for(profile, data, work, **train)
    if dry:
        params["evaluate"].update(beam_sizes=[1], alphas=[0.6], max_len_b=5)
    path = write_params(params, work)
    result: dict[str, Any] = {}
    for stage in (launcher, "average", "evaluate"):
        result[stage] = r.stage(f"{profile}-{stage}", stage, path, NMT_NPROC="1")
        if result[stage]["rc"] != 0:
            break
    result["metrics"] = _metrics(work)
    return result


def _curve(work: Path) -> list[dict[str, float]]:
    """``train.csv``'s rows without their empty cells."""
    return [{k: v for k, v in row.items() if v is not None} for row in read_history(work / "plots" / "train.csv")]


def step_precision(r: Runner, data: Path, profile: str, dry: bool) -> dict[str, Any]:
    """``profile`` (demo) for 200 steps (warm-up 100) in bf16 (the product) and fp32; loss at every 10th step."""
    steps = 6 if dry else 200
    train = {"max_steps": steps, "warmup_steps": steps // 2, "save_every_steps": steps,
             "valid_every_steps": max(steps // 4, 1),
             "log_every_steps": 2 if dry else 10}
    out: dict[str, Any] = {}
    curves = {}
    for name in ("bf16", "fp32"):
        work = r.work / f"precision-{name}"
        path = write_params(params_for(profile, data, work, **train), work)
        if name == "bf16":
            out[name] = r.stage("precision-bf16", "train", path)
        else:
            out[name] = r.cmd("precision-fp32", [sys.executable, __file__, "fp32-train", "--params", str(path)], 300)
        if out[name]["rc"] != 0:
            return out
        curves[name] = _curve(work)
    out["curves"] = curves
    out["compare"] = compare_curves(curves["bf16"], curves["fp32"])
    return out


def compare_curves(a: list[dict[str, float]], b: list[dict[str, float]]) -> dict[str, Any]:
    """Largest absolute and relative difference of each loss column, over the steps both logged."""
    by_step = {row["step"]: row for row in b}
    worst: dict[str, Any] = {}
    for column in ("train_loss", "train_nll", "valid_loss", "valid_nll"):
        pairs = [(row[column], by_step[row["step"]][column]) for row in a
                 if column in row and row["step"] in by_step and column in by_step[row["step"]]]
        if pairs:
            worst[column] = {"points": len(pairs), "max_abs": max(abs(x - y) for x, y in pairs),
                             "max_rel": max(abs(x - y) / abs(y) for x, y in pairs)}
    return worst


def step_determinism(r: Runner, data: Path, profile: str, dry: bool,
                      only: tuple[str, ...] = ("default", "deterministic")) -> dict[str, Any]:
    """Two uninterrupted runs and one killed after step ``kill`` and relaunched, per mode in ``only`` (torchrun,
    NCCL).

    The dry run does the default mode only (tests/pipeline/training/test_deterministic_kernels.py runs the
    switch on the CPU).
    """
    steps, every, kill = (6, 2, 3) if dry else (40, 10, 21)
    train = {"max_steps": steps, "warmup_steps": steps // 2, "save_every_steps": every, "valid_every_steps": steps,
             "log_every_steps": every}
    out: dict[str, Any] = {}
    modes = [(m, e) for m, e in (("default", {}), ("deterministic", {"NMT_DETERMINISTIC": "1"})) if m in only]
    for mode, extra in modes[:1] if dry else modes:
        runs: dict[str, Path] = {}
        for run in ("a", "b", "resumed"):
            work = r.work / f"det-{mode}-{run}"
            path = write_params(params_for(profile, data, work, **train), work)
            if run == "resumed":
                r.stage(f"det-{mode}-{run}-killed", "launch", path, NMT_FAULT_POINT=f"after_step:{kill}", **extra)
            done = r.stage(f"det-{mode}-{run}", "launch", path, **extra)
            if done["rc"] != 0:
                out[mode] = {"failed": f"det-{mode}-{run}", **done}
                break
            runs[run] = work / "train" / f"step-{steps:08d}"
        else:
            out[mode] = {"a_vs_b": compare_checkpoints(runs["a"], runs["b"]),
                         "a_vs_resumed": compare_checkpoints(runs["a"], runs["resumed"])}
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
    histories = [json.loads((d / "state.json").read_text(encoding="utf-8"))["history"] for d in (a, b)]
    result["history_equal"] = histories[0] == histories[1]
    return result


def step_attention(dry: bool) -> dict[str, Any]:
    """Seconds for 12 beam searches (beam 4, 12 steps, a random demo-sized model) whose shapes are new, then
    the same again, with the model's attention backends and with cuDNN's allowed first (PyTorch's own order)."""
    import torch
    from torch.nn.attention import SDPBackend

    import model.layers
    from model import Transformer, TransformerConfig, autocast, beam_search

    dev = torch.device("cpu" if dry else "cuda")
    torch.manual_seed(0)
    net = Transformer(TransformerConfig(vocab_size=8000, d_model=128, n_heads=4, d_ff=512, n_layers=3)).to(dev).eval()
    shipped = model.layers.CUDA_ATTENTION

    def searches(first: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode(), autocast(dev):
            for b in range(first, first + (2 if dry else 12)):
                src = torch.randint(4, 8000, (b, 5 + b % 23), device=dev)
                beam_search(net, src, beam_size=4, max_len_a=0.0, max_len_b=12)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return round(time.perf_counter() - started, 3)

    out: dict[str, Any] = {}
    for name, backends, first in (("shipped", shipped, 1), ("cudnn_allowed", [SDPBackend.CUDNN_ATTENTION, *shipped],
                                                                          100)):
        model.layers.CUDA_ATTENTION = backends
        try:
            out[name] = {"new_shapes_s": searches(first), "same_shapes_again_s": searches(first)}
        finally:
            model.layers.CUDA_ATTENTION = shipped
    return out


def step_throughput(r: Runner, dry: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    configs = ("small",) if dry else ("base", "base-25k")
    for config in configs:
        json_path = r.work / f"train-{config}.json"
        argv = [sys.executable, str(REPO / "benchmarks" / "train.py"), "--device", "cpu" if dry else "cuda",
                "--config", config, "--out", str(json_path)]
        argv += ["--repeats", "1", "--iters", "1"] if dry else ["--repeats", "5", "--iters", "10"]
        out[config] = r.cmd(f"throughput-{config}", argv, timeout=300)
        if json_path.is_file():
            result = json.loads(json_path.read_text(encoding="utf-8"))
            out[config].update(tgt_tokens_per_s=result["tgt_tokens_per_s"], target_tokens=result["target_tokens"])
    return out


def run(args: argparse.Namespace) -> int:
    r = Runner(args.out.resolve(), args.work.resolve(), "cpu" if args.dry_run else "cuda")
    data = args.data
    r.save("env", step_env())
    one, big = args.profiles
    steps = {"tiny": lambda: step_profile(r, data, one, "train", args.dry_run),
             "demo": lambda: step_profile(r, data, big, "launch", args.dry_run),
             "pytest": lambda: step_pytest(r, args.dry_run),
             "precision": lambda: step_precision(r, data, big, args.dry_run),
             "determinism": lambda: step_determinism(r, data, big, args.dry_run, tuple(args.modes)),
             "attention": lambda: step_attention(args.dry_run),
             "throughput": lambda: step_throughput(r, args.dry_run)}
    for name in args.steps or list(steps):
        r.step(name, steps[name])
    print(json.dumps(r.results, indent=1, default=str)[-6000:])
    return 0


def prepare(args: argparse.Namespace) -> int:
    """The data stages of the tiny and demo profiles, here (the device machine has no data)."""
    r = Runner(REPO / args.data / "prepare", REPO / args.data / "prepare", "cpu")
    for profile in args.profiles:
        path = write_params(params_for(profile, args.data, None), REPO / args.data / profile)
        for stage in DATA_STAGES:
            done = r.stage(f"{profile}-{stage}", stage, path, timeout=1800)
            if done["rc"] != 0:
                log.error("%s %s failed: see %s", profile, stage, r.work / "logs" / f"{profile}-{stage}.log")
                return 1
    return 0


def fp32_train(args: argparse.Namespace) -> int:
    """The train stage with autocast off: the fp32 reference for the bf16 curves."""
    import torch

    from pipeline import train
    from pipeline.training import loop, preflight

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    loop.autocast = preflight.autocast = lambda device: contextlib.nullcontext()
    return train.main(["--params", str(args.params)])


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--data", type=Path, required=True, help="a folder under data/ (relative to the repository)")
    a.add_argument("--profiles", nargs="+", default=["tiny", "demo"])
    a = sub.add_parser("run")
    a.add_argument("--data", type=Path, required=True)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--work", type=Path, default=Path("/tmp/gpu_check"), help="runs and logs (default: %(default)s)")
    a.add_argument("--dry-run", action="store_true", help="CPU, a few steps: checks this script")
    a.add_argument("--steps", nargs="*", help="a subset of the steps, in order")
    a.add_argument("--profiles", nargs=2, default=["tiny", "demo"], metavar=("ONE_PROCESS", "TORCHRUN"))
    a.add_argument("--modes", nargs="+", default=["default", "deterministic"], choices=["default", "deterministic"],
                   help="the determinism step's modes (default: both)")
    a = sub.add_parser("fp32-train")
    a.add_argument("--params", type=Path, required=True)
    args = p.parse_args(argv)
    return {"prepare": prepare, "run": run, "fp32-train": fp32_train}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
