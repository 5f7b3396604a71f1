"""Measured items about training, from the train stage's record, else the newest checkpoint's ``state.json``.

A configured value is not a measured one: ``train.tokens_per_step = 25000`` with 31,500 target tokens per step
measured is a deviation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.auditing.items import Item, fmt, item
from pipeline.auditing.paper_rows import paper_row
from pipeline.auditing.settings import approx
from pipeline.core.details import TrainDetails

if TYPE_CHECKING:
    from pipeline.auditing.inputs import Inputs

#: Measured target (and source) tokens per step within this (relative) of the paper's ~25,000 match.
TOKENS_REL = 0.1
#: The averaged checkpoints may span at most this share of training (params.yaml's averaging rule).
AVERAGE_SPAN_MAX = 0.20
#: A dev perplexity at most this much (relative) above Table 3's 4.92 matches.
PPL_REL = 0.05


def _count(inp: Inputs, key: str) -> int | None:
    """``step``, ``tokens_seen`` or ``world_size``: the train stage's record, else the newest state.json."""
    value = getattr(inp.details.train, key)
    return (inp.state or {}).get(key) if value is None else value


def final_step(inp: Inputs) -> int | None:
    """The last training step: the train stage's record, else the newest checkpoint's state.json."""
    return _count(inp, "step")


def _hours(train: TrainDetails) -> tuple[float | None, str]:
    if train.resumed_from_step is None and train.wall_seconds is not None:
        return train.wall_seconds / 3600, "wall-clock of the training stage"
    if train.train_seconds is not None:
        return train.train_seconds / 3600, "cumulative step time (resumed run; excludes restarts)"
    return None, ""


def _tokens_per_step(inp: Inputs, steps: int | None, tokens: int | None) -> Item:
    train = inp.details.train
    mean, how = train.tokens_per_step_mean, "mean over the optimizer steps"
    if mean is None and tokens is not None and steps:
        mean, how = tokens / steps, "tokens_seen / step"
    notes = [f"non-pad target tokens per optimizer step ({how})"]
    std, low, high = train.tokens_per_step_std, train.tokens_per_step_min, train.tokens_per_step_max
    if std is not None:
        notes.append(f"std {std:,.0f}")
    if low is not None and high is not None:
        notes.append(f"min-max {low:,.0f}-{high:,.0f}")
    configured = inp.params.train.tokens_per_step
    notes.append(f"params train.tokens_per_step = {fmt(configured)}")
    return item("Target tokens per step", paper="~25,000", source="§5.1", note="; ".join(notes),
                run=None if mean is None else f"{mean:,.0f}",
                ok=None if mean is None else approx(mean, paper_row(inp.params)["tokens_per_step"], TOKENS_REL),
                deviation=f"{mean or 0:,.0f} target tokens per step (paper: ~25,000; within 10% matches)")


def _src_tokens_per_step(inp: Inputs) -> Item:
    mean = inp.details.train.src_tokens_per_step_mean
    return item("Source tokens per step", paper="~25,000", source="§5.1", run=None if mean is None else f"{mean:,.0f}",
                ok=None if mean is None else approx(mean, paper_row(inp.params)["tokens_per_step"], TOKENS_REL),
                deviation=f"{mean or 0:,.0f} source tokens per step (paper: ~25,000; within 10% matches)",
                note="non-pad source tokens (with EOS) per optimizer step, mean; steps are filled by target tokens "
                     "(train.tokens_per_step), so the source side follows the data's length ratio")


def _volume_items(inp: Inputs) -> list[Item]:
    """Steps, target tokens, target and source tokens per step."""
    steps = final_step(inp)
    tokens, row = _count(inp, "tokens_seen"), paper_row(inp.params)
    total = f"~{row['target_tokens'] / 1e9:.1f}B"
    return [item("Steps trained", paper=f"{row['steps']:,}", run=None if steps is None else f"{steps:,}",
                 ok=None if steps is None else steps == row["steps"], source="§5.2",
                 deviation=f"{steps or 0:,} steps trained (paper: {row['steps']:,})"),
            item("Target tokens trained", paper=f"{total} ({row['steps'] // 1000}k steps x ~25k)", source="§5.1-5.2",
                 run=None if tokens is None else f"{tokens:,}",
                 deviation=f"{tokens or 0:,} target tokens trained (paper: {total})",
                 ok=None if tokens is None else approx(tokens, row["target_tokens"], 0.1)),
            _tokens_per_step(inp, steps, tokens), _src_tokens_per_step(inp)]


def _batch_shape_items(inp: Inputs) -> list[Item]:
    """World size and forward passes per step: how the batch was split, not what it was (informational)."""
    train, world = inp.details.train, _count(inp, "world_size")
    mean, most = train.forwards_per_step_mean, train.forwards_per_step_max
    return [
        item("World size", paper="8 GPUs (§5.2)", source="§5.2", ok=None, verdict="informational",
             run=None if world is None else f"{world} process(es)",
             note="the batch is judged by the target tokens per step: another world size with the same tokens per "
                  "step trains on the same batch; Hardware judges the machines"),
        item("Forward passes per step", paper="not stated (the batch of ~25,000 target tokens spans 8 GPUs)",
             source="§5.1-5.2", ok=None, verdict="informational",
             run=None if mean is None else f"mean {mean:.2f}, max {fmt(most)} (busiest rank)",
             note="more passes per step split the same batch (gradient accumulation); tokens per step judge it"),
    ]


def _machine_items(inp: Inputs) -> list[Item]:
    """Training time, hardware and GPU-hours."""
    train, row = inp.details.train, paper_row(inp.params)
    hours, how = _hours(train)
    paper_h = f"{row['wall_clock_hours']:g} h"
    gpus = f"{row['gpu_hours']:g} P100-hours (8 x {paper_h})"
    out = [item("Training time", paper=paper_h, source="§5.2", note=how, run=None if hours is None else
                f"{hours:.3f} h" if hours >= 0.1 else f"{hours:.3f} h ({hours * 3600:.1f} s)",
                ok=None if hours is None else approx(hours, row["wall_clock_hours"], 0.1),
                deviation=f"trained {hours or 0:.3f} h (paper: {paper_h})")]
    device, world = train.device, _count(inp, "world_size")
    name = train.device_name or device
    hw = None if device is None else f"{world} x {name}"
    out.append(item("Hardware", paper="8 x NVIDIA P100", source="§5.2", run=hw,
                    deviation=f"trained on {hw} (paper: 8 x P100)",
                    ok=None if device is None else world == 8 and "P100" in str(name),
                    note="" if device else "train.json records no device"))
    gpu_h = hours * world if hours is not None and world and str(device).startswith("cuda") else None
    why = None if gpu_h is not None else ("no GPU: trained on " + str(device)) if device else None
    out.append(item("GPU-hours", paper=gpus, source="§5.2",
                    run=f"{gpu_h:.2f}" if gpu_h is not None else why and f"not measured ({why})",
                    ok=None if gpu_h is None else approx(gpu_h, row["gpu_hours"], 0.1),
                    deviation=f"{gpu_h or 0:.2f} GPU-hours on {name} (paper: {row['gpu_hours']:g} P100-hours)",
                    note="wall-clock x world size; different GPUs: hours, not work"))
    bf16 = None if device is None else str(device).startswith("cuda")
    out.append(item("Training precision", paper="fp32 (P100s have no bf16; tensor2tensor's default)", source="§5.2",
                    run=None if bf16 is None else "bf16 autocast, fp32 weights and loss" if bf16 else "fp32",
                    ok=None if bf16 is None else not bf16, deviation="bf16 autocast on the GPU (paper: fp32)",
                    note="model/precision.py: bf16 autocast on CUDA, fp32 elsewhere"))
    return out


def training_items(inp: Inputs) -> list[Item]:
    """Steps, tokens, tokens per step (measured, both sides), world size, forward passes, time, hardware, GPU-hours."""
    return _volume_items(inp) + _batch_shape_items(inp) + _machine_items(inp)
