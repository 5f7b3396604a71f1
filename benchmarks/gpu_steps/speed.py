"""``benchmarks/gpu.py speed``: the train stage's own step at base dimensions on news lengths, compiled and eager,
its tokens/s read from the stage's own progress lines, the compiled run profiled (``profiled_train.py``);
``benchmarks/train.py``'s step beside ``nn.Transformer``."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, write_params
from benchmarks.gpu_steps.runner import Runner, params_for

#: The stage's run: the paper profile (base, post-norm, 37k vocabulary) on the news sets' lengths, ~25k target
#: tokens per optimizer step in one forward pass (``NMT_MAX_TOKENS``), a progress line every 20 steps.
STAGE_TRAIN = {"tokens_per_step": 25000, "max_steps": 300, "warmup_steps": 100, "log_every_steps": 20,
               "save_every_steps": 300, "valid_every_steps": 300, "max_minutes": 3.0}
#: The compiled run is profiled for 5 optimizer steps after this many (benchmarks/gpu_steps/profiled_train.py).
PROFILE_SKIP = 200
DRY_STAGE = {"model": {"d_model": 32, "n_heads": 2, "d_ff": 64, "n_layers": 1},
             "train": {"tokens_per_step": 512, "max_steps": 6, "warmup_steps": 2, "log_every_steps": 2,
                       "save_every_steps": 6, "valid_every_steps": 6, "max_minutes": 0}}
PROGRESS = re.compile(r"step (\d+)/\d+ .*?\| ([\d.]+) tgt tok/s(?: \| MFU ([\d.]+)%)? \| (\d+) tok/step "
                      r"in ([\d.]+) passes")


def steps(r: Runner, data: Path, dry: bool) -> dict[str, tuple[Any, float]]:
    """The ``speed`` steps in order, each with the seconds it needs on the device."""
    return {"stage": (lambda: step_stage(r, data, dry, compiled=True), 280),
            "stage-eager": (lambda: step_stage(r, data, dry, compiled=False), 60),
            "bench": (lambda: step_bench(r, dry), 120)}


def progress(log_text: str) -> list[dict[str, float]]:
    """The stage's progress lines as rows: step, tokens/s, MFU, target tokens per step, passes per step."""
    return [{"step": int(m[1]), "tgt_tokens_per_s": float(m[2]), "mfu": float(m[3]) / 100 if m[3] else None,
             "tgt_tokens_per_step": int(m[4]), "passes": float(m[5])} for m in PROGRESS.finditer(log_text)]


def step_stage(r: Runner, data: Path, dry: bool, compiled: bool) -> dict[str, Any]:
    """``python -m pipeline.train`` on the news shards; its progress rows (the first holds the compile)."""
    name = "stage-compiled" if compiled else "stage-eager"
    work = r.work / name
    params = params_for("paper", data, work, dataset="news", **STAGE_TRAIN)
    for section, values in (DRY_STAGE if dry else {}).items():
        params[section].update(values)
    if not compiled and not dry:
        params["train"].update(max_steps=40, warmup_steps=20, save_every_steps=40, valid_every_steps=40,
                               max_minutes=1.0)
    extra = {"NMT_COMPILE": "on" if compiled else "off", "NMT_MAX_TOKENS": "2048" if dry else "65536"}
    timeout = max(min(r.left() - 30, 320), 30)
    if compiled:  # under the profiler from the step after PROFILE_SKIP: the rows before it are the clean figures
        argv = [sys.executable, "-m", "benchmarks.gpu_steps.profiled_train", "--params",
                str(write_params(params, work)), "--out", str(r.work / "logs"),
                "--skip", str(3 if dry else PROFILE_SKIP)]
        done = r.cmd(name, argv, timeout, **extra)
    else:
        done = r.stage(name, "train", write_params(params, work), timeout=timeout, **extra)
    rows = progress((r.work / "logs" / f"{name}.log").read_text(encoding="utf-8", errors="replace"))
    steady = [row["tgt_tokens_per_s"] for row in rows[1:] if not compiled or row["step"] <= PROFILE_SKIP]
    profiled = r.work / "logs" / "profile.json"
    profile = json.loads(profiled.read_text(encoding="utf-8")) if compiled and profiled.is_file() else None
    return {**done, "env": extra, "train": params["train"], "rows": rows,
            "steady_tgt_tokens_per_s": sorted(steady)[len(steady) // 2] if steady else None,
            **({"profile": profile} if profile else {})}


def step_bench(r: Runner, dry: bool) -> dict[str, Any]:
    """``benchmarks/train.py``: ours compiled (lean loss, causal attention on the efficient kernel) vs
    ``nn.Transformer`` on the news-25k plan."""
    path = r.work / "train-news-25k.json"
    argv = [sys.executable, str(REPO / "benchmarks" / "train.py"), "--out", str(path)]
    argv += (["--device", "cpu", "--config", "small", "--threads", "1", "--repeats", "1", "--iters", "1"] if dry else
             ["--device", "cuda", "--config", "news-25k", "--repeats", "3", "--iters", "10", "--max-tokens", "32768",
              "--compile", "step", "--dynamic", "--loss", "lean"])
    done = r.cmd("bench", argv, timeout=max(r.left() - 10, 30))
    return {**done, **({"result": json.loads(path.read_text(encoding="utf-8"))} if path.is_file() else {})}
