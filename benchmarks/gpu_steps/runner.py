"""What every ``benchmarks/gpu.py`` command shares: params for a profile, stages run as subprocesses with a log
each and a time limit, the results JSON rewritten after every step, the time left of ``--budget-s``."""

from __future__ import annotations

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
from typing import Any, TypedDict

from benchmarks.common import REPO
from pipeline.project.profiles import merged_profile

log = logging.getLogger("gpu")
DATA_STAGES = ("download", "clean", "bpe", "encode")
DATA_PATHS = ("raw", "clean", "bpe", "shards")
RUN_PATHS = ("train", "model", "eval", "metrics", "plots", "reports")
#: A dry run's budget (its subprocesses' time limits): it checks the script, not a device call's time.
DRY_BUDGET_S = 3600.0


def params_for(profile: str, data: Path, work: Path | None, dataset: str = "", **train: Any) -> dict:
    """Profile ``profile``'s params: data paths under ``data/<dataset or profile>``, run paths under ``work``.
    An absolute ``data`` goes through a link ``work/data`` (pipeline/core/paths.py takes no outside absolute path)."""
    if work is not None and data.is_absolute():
        work.mkdir(parents=True, exist_ok=True)
        if not (work / "data").is_symlink():
            (work / "data").symlink_to(data, target_is_directory=True)
        data = work / "data"
    params = merged_profile(profile, REPO)
    params["paths"].update({k: str(data / (dataset or profile) / k) for k in DATA_PATHS})
    if work is not None:
        params["paths"].update({k: str(work / k) for k in RUN_PATHS})
    params["train"].update(train)
    return params


class Done(TypedDict):
    """A command's exit code (``timeout``: killed at its limit) and wall seconds."""

    rc: int | str
    seconds: float


class Runner:
    """Runs commands with a log file each, keeps the results JSON up to date and counts down ``budget_s``."""

    def __init__(self, out: Path, work: Path, device: str, results: str = "", budget_s: float = DRY_BUDGET_S) -> None:
        self.out, self.work, self.device, self.results_name = out, work, device, results
        self.end = time.monotonic() + budget_s
        (work / "logs").mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device}

    def left(self) -> float:
        """Seconds left of the budget."""
        return self.end - time.monotonic()

    def env(self, **extra: str) -> dict[str, str]:
        """The stages' environment: tracking off (the device image has no MLflow), no restarts, this device."""
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "NMT_TRACKING": "off", "NMT_DEVICE": self.device, "PYTHONPATH": path,
                "PYTHONUNBUFFERED": "1", "NMT_MAX_RESTARTS": "0", **extra}

    def cmd(self, name: str, argv: list[str], timeout: float, **extra: str) -> Done:
        """Run ``argv`` from the repository root; its output goes to ``logs/<name>.log``."""
        started = time.monotonic()
        with (self.work / "logs" / f"{name}.log").open("w", encoding="utf-8") as fh:
            try:
                rc = subprocess.run(argv, check=False, cwd=REPO, env=self.env(**extra), stdout=fh,
                                    stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        done = Done(rc=rc, seconds=round(time.monotonic() - started, 2))
        log.info("%-32s rc=%s %7.1f s", name, rc, done["seconds"])
        return done

    def stage(self, name: str, stage: str, params: Path, timeout: float = 300, **extra: str) -> Done:
        """``python -m pipeline.<stage> --params params`` (``launch``: the torchrun launcher)."""
        module = "pipeline.launch" if stage == "launch" else f"pipeline.{stage}"
        return self.cmd(name, [sys.executable, "-m", module, "--params", str(params)], timeout, **extra)

    def data_stages(self, name: str, params: Path, stages: tuple[str, ...] = DATA_STAGES) -> bool:
        """The data stages of ``params`` one after another; False (and the log named) at the first failure."""
        for stage in stages:
            if self.stage(f"{name}-{stage}", stage, params, timeout=1800)["rc"] != 0:
                log.error("%s %s failed: see %s", name, stage, self.work / "logs" / f"{name}-{stage}.log")
                return False
        return True

    def chain(self, name: str, work: Path, timeout: float, launcher: str = "train", **extra: str) -> dict[str, Any]:
        """``launcher`` -> ``average`` -> ``evaluate`` on ``work/params.yaml`` and their metrics; a failed train
        still averages what it saved (a paused run exits 1)."""
        params, result, started = work / "params.yaml", {}, time.monotonic()
        for stage in (launcher, "average", "evaluate"):
            left = timeout - (time.monotonic() - started)
            result[stage] = self.stage(f"{name}-{stage}", stage, params, timeout=max(left, 1), **extra)
            if result[stage]["rc"] != 0 and stage != launcher:
                break
        found = sorted((work / "metrics").glob("*.json"))
        result["metrics"] = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in found}
        return result

    def run_steps(self, steps: dict[str, tuple[Callable[[], Any], float]], names: list[str] | None, dry: bool) -> None:
        """Each named step (default all) that has its seconds left of the budget, saving its result or error."""
        for name in names or list(steps):
            do, needs = steps[name]
            if self.left() < needs and not dry:
                log.warning("step %s skipped: %.0f s left, it needs ~%d", name, self.left(), needs)
                self.save(name, {"skipped": f"{self.left():.0f} s left"})
                continue
            started = time.monotonic()
            try:
                self.save(name, do())
            except Exception as exc:  # saved: the next step's figures are worth having
                log.exception("step %s failed", name)
                self.save(name, {"error": repr(exc)})
            log.info("step %s: %.1f s", name, time.monotonic() - started)
        log.info("results:\n%s", json.dumps(self.results, indent=1, default=str)[-8000:])

    def save(self, step: str, value: Any) -> None:
        """Record ``value`` under ``step``; rewrite the JSON and ``logs.tar.gz`` (logs and loss curves)."""
        self.results[step] = value
        text = json.dumps(self.results, indent=1, default=str) + "\n"
        (self.out / self.results_name).write_text(text, encoding="utf-8")
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:  # few files come back from a device call
            tar.add(self.work / "logs", arcname="logs")
            for curve in sorted(self.work.glob("*/plots/train.csv")) + sorted(self.work.glob("*.json")):
                tar.add(curve, arcname=str(curve.relative_to(self.work)))


def step_env() -> dict[str, str | float | bool]:
    """torch, Python, the CUDA device and NCCL versions, ``nvidia-smi -L``."""
    import torch

    info: dict[str, str | float | bool] = {"torch": torch.__version__, "python": platform.python_version(),
                            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", memory_gib=props.total_memory / 2**30,
                    sms=props.multi_processor_count, cuda=torch.version.cuda, devices=torch.cuda.device_count(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    if smi := shutil.which("nvidia-smi"):
        info["nvidia_smi"] = subprocess.run([smi, "-L"], check=False, capture_output=True, text=True).stdout.strip()
    return info


def step_throughput(r: Runner, dry: bool) -> dict[str, Any]:
    """``benchmarks/train.py`` on the base model's 25k-token compiled step (dry run: the toy config on the CPU,
    which checks the wiring; tests/benchmarks/test_train_benchmark.py checks the script itself)."""
    json_path = r.work / "train-base-25k.json"
    argv = [sys.executable, str(REPO / "benchmarks" / "train.py"), "--out", str(json_path)]
    argv += (["--device", "cpu", "--config", "toy", "--threads", "1", "--repeats", "1", "--iters", "1"] if dry else
             ["--device", "cuda", "--config", "base-25k", "--repeats", "3", "--iters", "10", "--compile", "step"])
    done = r.cmd("throughput", argv, timeout=max(r.left() - 10, 30))
    return {**done, **({"result": json.loads(json_path.read_text(encoding="utf-8"))} if json_path.is_file() else {})}
