"""``python -m benchmarks.gpu_steps.profiled_train --params P --out DIR --skip N --active K``: the train stage
(``python -m pipeline.train``, unchanged) under ``torch.profiler`` for K optimizer steps after the first N (the
compile and warm-up), counted by an optimizer step hook. Writes ``DIR/profile.txt`` (the operators by self GPU
time, and a table by kind of kernel) and ``DIR/profile.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

#: Kernel kinds by name (the first match wins); what matches none is "other".
KINDS = (("attention", r"fmha|flash|attention|efficient"), ("inductor (triton)", r"^triton_"),
         ("matmul", r"gemm|nvjet|xmma|cutlass|matmul|sm90"), ("optimizer", r"adam|multi_tensor"),
         ("copy/fill", r"memcpy|memset|copy|fill|cat"), ("other elementwise/reduce", r"elementwise|reduce|vectorized"))
#: GPU-side ranges of CPU annotations (the profiler's steps, ``Optimizer.step#...``): not kernels.
ANNOTATION = re.compile(r"^ProfilerStep|#")


def kind(name: str) -> str:
    """The kind of one kernel, by :data:`KINDS`."""
    return next((k for k, pattern in KINDS if re.search(pattern, name, re.I)), "other")


def summarize(prof: Any, out: Path) -> None:
    """The operators' table and the share of GPU time per kind of kernel over the active steps; the wall is the
    span from the first kernel's start to the last one's end."""
    kernels: dict[str, float] = {}
    spans: list[tuple[float, float]] = []
    steps = sum(event.name.startswith("ProfilerStep") for event in prof.events())
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not ANNOTATION.search(event.name):
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time / 1e3  # ms
            spans.append((event.time_range.start, event.time_range.end))
    busy = sum(kernels.values())
    by_kind: dict[str, float] = {}
    for name, ms in kernels.items():
        by_kind[kind(name)] = by_kind.get(kind(name), 0.0) + ms
    wall = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3 if spans else float("nan")
    rows = sorted(by_kind.items(), key=lambda kv: -kv[1])
    lines = [f"{steps} steps: wall {wall:.1f} ms, GPU busy {busy:.1f} ms ({busy / wall:.1%} of the wall)",
             "| kind | ms | share of GPU time |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {ms:.1f} | {ms / busy:.1%} |" for k, ms in rows]
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    lines += ["", "top kernels (ms over the active steps):"] + [f"{ms:9.2f}  {kind(n):24s} {n[:150]}" for n, ms in top]
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
    (out / "profile.txt").write_text("\n".join(lines) + "\n\n" + table + "\n", encoding="utf-8")
    (out / "profile.json").write_text(json.dumps({"steps": steps, "wall_ms": wall, "gpu_busy_ms": busy,
                                                  "by_kind_ms": dict(rows), "top_kernels_ms": dict(top)}, indent=1),
                                      encoding="utf-8")


def main() -> int:
    """Start the profiler, hook the optimizer's steps, and run the stage as ``python -m pipeline.train``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--skip", type=int, default=200, help="optimizer steps before the profiled ones")
    p.add_argument("--active", type=int, default=5, help="optimizer steps profiled")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=args.skip, warmup=1, active=args.active, repeat=1),
                   on_trace_ready=lambda pr: summarize(pr, args.out))
    prof.start()
    register_optimizer_step_post_hook(lambda *_: prof.step())
    sys.argv = ["pipeline.train", "--params", args.params]
    try:
        runpy.run_module("pipeline.train", run_name="__main__", alter_sys=True)
    finally:
        prof.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
