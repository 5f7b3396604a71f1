"""The training loop: the Transformer on token-budget batches, on one or many processes (torchrun).

``python -m pipeline.launch`` starts ``torchrun -m pipeline.train``; run alone, that module trains
in a single process. Each optimizer step (:func:`train_step`, read it top to bottom) runs
``A = ceil(tokens_per_step / (world × max_tokens))`` micro-batches per rank; before each one the
global torch (and CUDA) generators are reseeded from (seed, epoch, global micro-batch index), so
dropout does not depend on which rank ran it. Losses are sums; after accumulation the gradients are
summed over ranks and divided by the step's global number of non-pad target tokens, so the update
does not depend on how the tokens fell into micro-batches or ranks. A relaunch resumes from the
newest complete checkpoint (:mod:`pipeline.training.setup`).

A pre-flight on the plan's largest micro-batch shapes fails fast when memory is short; a later
out-of-memory error skips that optimizer step on every rank and is counted (:mod:`pipeline.training.preflight`).
Fault injection for the crash tests reaches the loop only through its ``hooks``
(:mod:`pipeline.training.faults`; a no-op unless ``NMT_FAULT_POINT`` is set).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model import TransformerConfig, autocast, inverse_sqrt_lr, label_smoothed_nll_loss
from pipeline.core import tracking
from pipeline.core.config import TrainConfig
from pipeline.core.errors import PipelineError
from pipeline.core.textio import write_text
from pipeline.data import batching
from pipeline.training import distributed, faults, preflight, setup
from pipeline.training.logs import PEAK_FLOPS, TrainLog, history_csv, log_valid, perplexity
from pipeline.training.setup import Trainer
from pipeline.training.state import TrainState

log = logging.getLogger(__name__)


def micro_seed(seed: int, epoch: int, index: int) -> int:
    """The torch seed of global micro-batch ``index`` of ``epoch``."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


def train_step(tr: Trainer, micro_batches: list, state: TrainState) -> dict[str, float] | None:
    """One optimizer step: accumulate → all-reduce → divide by the global token count → clip → finite
    check → learning rate → Adam step.

    Args:
        tr: the run. micro_batches: this rank's share of the step (``None`` for an empty slot).
        state: the position before the step (not changed here).

    Returns:
        The step's global ``loss_sum``, ``nll_sum``, ``tokens``, ``lr`` and ``grad_norm``; None when a
        rank ran out of memory (every rank then skips the step: the OOM flag travels with the sums).

    Raises:
        PipelineError: a non-finite loss or gradient norm (the step is not taken).
    """
    model, dev, rank, step = tr.model, tr.ctx.device, tr.ctx.rank, state.step + 1
    sums, tokens, oom = torch.zeros(2, dtype=torch.float64, device=dev), 0, None  # loss_sum, nll_sum
    for i, batch in enumerate(micro_batches):  # 1. forward + backward of this rank's micro-batches (sums)
        if batch is None:
            continue
        torch.manual_seed(micro_seed(tr.seed, state.epoch, batch.index))
        b = batch.to(dev)
        try:
            tr.hooks.at("forward", step, rank)
            with autocast(dev):
                logits = model(b.src, b.tgt_in)
            loss_sum, nll_sum = label_smoothed_nll_loss(logits, b.tgt_out, epsilon=tr.cfg.label_smoothing,
                                                        ignore_index=model.cfg.pad_id)
            loss_sum.backward()
        except torch.OutOfMemoryError:
            oom = f"micro-batch {batch.index}: src {list(b.src.shape)}, tgt {list(b.tgt_in.shape)}"
            break
        sums += torch.stack([loss_sum.detach(), nll_sum.detach()]).double()
        tokens += b.n_tokens
        if i + 1 < len(micro_batches):
            tr.hooks.at("mid_accum", step, rank)
    stats = torch.cat([sums, torch.tensor([float(tokens), float(oom is not None)], dtype=torch.float64, device=dev)])
    tr.hooks.at("collective", step, rank)
    distributed.all_reduce_sum(stats)  # 2. the global loss sums, non-pad target tokens and OOM ranks
    loss_sum, nll_sum, tokens, oom_ranks = stats.tolist()
    if oom_ranks:
        model.zero_grad(set_to_none=True)
        preflight.skip_step(state, oom, rank=rank, device=dev)
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    distributed.all_reduce_grads(params)  # 3. gradient sums over ranks ...
    grads = [p.grad for p in params]
    torch._foreach_div_(grads, tokens)  # ... divided by the step's global non-pad target tokens
    norm = torch.nn.utils.get_total_norm(grads)
    if tr.cfg.clip_norm > 0:  # 4. clip (the paper does not)
        torch.nn.utils.clip_grads_with_norm_(params, tr.cfg.clip_norm, norm)
    norm = float(norm)
    if not (math.isfinite(loss_sum) and math.isfinite(norm)):  # 5. finite check
        raise PipelineError(
            f"train step {step}: non-finite {'loss' if not math.isfinite(loss_sum) else 'gradient norm'} "
            f"(loss sum {loss_sum}, grad norm {norm}); the optimizer step was not taken. Lower train.lr_scale, "
            "set train.clip_norm (e.g. 1.0) or check the data, then move paths.train away and retrain "
            "(checkpoints resume only under the configuration that wrote them).")
    lr = inverse_sqrt_lr(step, model.cfg.d_model, tr.cfg.warmup_steps, tr.cfg.lr_scale)  # 6. learning rate
    for group in tr.optim.param_groups:
        group["lr"] = lr
    tr.optim.step()  # 7. Adam step
    tr.optim.zero_grad(set_to_none=True)
    return {"loss_sum": loss_sum, "nll_sum": nll_sum, "tokens": tokens, "lr": lr, "grad_norm": norm}


@torch.no_grad()
def validate(tr: Trainer) -> dict[str, float]:
    """Loss per token, NLL per token and perplexity on the valid split (split over ranks)."""
    model, dev, cfg = tr.model, tr.ctx.device, tr.model.cfg
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=dev)
    for ids in tr.valid_batches[tr.ctx.rank::tr.ctx.world_size]:
        b = batching.collate(tr.valid.fetch(ids), pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id).to(dev)
        with autocast(dev):
            logits = model(b.src, b.tgt_in)
        loss_sum, nll_sum = label_smoothed_nll_loss(logits, b.tgt_out, epsilon=tr.cfg.label_smoothing,
                                                    ignore_index=cfg.pad_id)
        stats += torch.tensor([float(loss_sum), float(nll_sum), float(b.n_tokens)], dtype=torch.float64,
                              device=dev)
    model.train()
    loss_sum, nll_sum, tokens = distributed.all_reduce_sum(stats).tolist()
    tokens = max(tokens, 1.0)
    return {"valid_loss": loss_sum / tokens, "valid_nll": nll_sum / tokens, "valid_ppl": perplexity(nll_sum / tokens)}


def _should_stop(tr: Trainer, state: TrainState, elapsed: float, *, timed: bool = True) -> bool:
    """Whether a limit is reached; the time limit (agreed over ranks) only when ``timed``."""
    cfg = tr.cfg
    if state.step >= cfg.max_steps or (cfg.max_epochs and state.epoch >= cfg.max_epochs):
        return True
    if timed and cfg.max_minutes > 0:
        seconds = torch.tensor([elapsed], dtype=torch.float64, device=tr.ctx.device)
        return float(distributed.all_reduce_max(seconds)) >= cfg.max_minutes * 60
    return False


def fit(tr: Trainer, state: TrainState, *, run_dir: Path, tracker: Any) -> None:
    """Train until max_steps, max_epochs or max_minutes; validate, log and checkpoint on the way."""
    cfg, model_cfg = tr.cfg, tr.model.cfg
    peak = PEAK_FLOPS * tr.ctx.world_size if tr.ctx.device.type == "cuda" else 0.0
    logs = TrainLog(tracker, max_steps=cfg.max_steps, max_minutes=cfg.max_minutes,
                    flops_per_token=tr.flops_per_token, peak_flops=peak, start_step=state.step)
    tr.model.train()
    while not _should_stop(tr, state, logs.elapsed(), timed=False):  # time is checked after each step
        steps = batching.epoch_steps(tr.batches, tr.train.fetch, seed=tr.seed, epoch=state.epoch, start=state.micro,
                                     rank=tr.ctx.rank, world_size=tr.ctx.world_size, accum=tr.accum,
                                     pad_id=model_cfg.pad_id, bos_id=model_cfg.bos_id, eos_id=model_cfg.eos_id,
                                     pin=tr.ctx.device.type == "cuda")
        with contextlib.closing(steps):
            for micro_batches in steps:
                started = time.monotonic()
                stats = train_step(tr, micro_batches, state)
                state.advance(tr.ctx.world_size * tr.accum, len(tr.batches))
                if stats is not None:  # None: skipped for lack of memory
                    state.oom_streak, state.step = 0, state.step + 1
                    state.tokens_seen += int(stats["tokens"])
                    state.train_seconds += time.monotonic() - started
                    logs.add(stats)
                    _after_step(tr, state, stats, logs, run_dir=run_dir, tracker=tracker)
                if _should_stop(tr, state, logs.elapsed()):
                    return


def _after_step(tr: Trainer, state: TrainState, stats: dict[str, float], logs: TrainLog, *, run_dir: Path,
                tracker: Any) -> None:
    cfg = tr.cfg
    if state.step % cfg.log_every_steps == 0:
        logs.line(state, stats)
    if state.step % cfg.valid_every_steps == 0:
        log_valid(tracker, state, validate(tr))
    if state.step % cfg.save_every_steps == 0:
        setup.save(tr, state, run_dir, tracker.run_id)
    tr.hooks.at("after_step", state.step, tr.ctx.rank)


def _finish(tr: Trainer, state: TrainState, *, run_dir: Path, tracker: Any, wall: float,
            resumed_from: int | None) -> dict[str, Any]:
    """Validate and checkpoint the last step (unless just done); the stage's summary."""
    last_valid = next((h for h in reversed(state.history) if "valid_loss" in h), None)
    if last_valid is None or last_valid["step"] != state.step:
        log_valid(tracker, state, validate(tr))
        last_valid = state.history[-1]
    setup.save(tr, state, run_dir, tracker.run_id)
    last_train = next((h for h in reversed(state.history) if "train_loss" in h), {})
    dev = tr.ctx.device
    return {"step": state.step, "epoch": state.epoch, "tokens_seen": state.tokens_seen,
            "world_size": tr.ctx.world_size, "accumulation": tr.accum, "micro_batches": len(tr.batches),
            **{k: v for k, v in last_train.items() if k.startswith("train_")},
            **{k: v for k, v in last_valid.items() if k.startswith("valid_")},
            "train_seconds": round(state.train_seconds, 3), "wall_seconds": round(wall, 3),
            "tgt_tokens_per_s": state.tokens_seen / max(state.train_seconds, 1e-9),
            "resumed_from_step": resumed_from, "oom_skipped_steps": state.oom_skipped,
            "device": dev.type,
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}


def train(cfg: TrainConfig, *, model_cfg: TransformerConfig, seed: int, shards_dir: str | Path, spm_model: str | Path,
          run_dir: str | Path, plots_path: str | Path, device: str | None = None,
          hooks: faults.Hooks | None = None) -> dict:
    """Train (or resume) the Transformer; every rank of a torchrun job calls this.

    Args:
        cfg: the ``train`` section.
        model_cfg: the ``model`` section (the vocabulary size comes from ``spm_model``).
        seed: the global seed (weights, batch order, dropout).
        shards_dir: the encode stage's output (manifest.json + train/valid shards).
        spm_model: the BPE model the shards were encoded with.
        run_dir: the checkpoint folder (``<paths.train>``; persistent, resumable).
        plots_path: ``train.csv`` with one row per logged step (written by rank 0).
        device: ``cpu`` forces CPU (default: CUDA when available).
        hooks: fault-injection hooks (default: from the environment; no-ops normally).

    Returns:
        The final step, epoch, tokens, losses, perplexities, throughput, world size and device.
    """
    wall0 = time.monotonic()
    ctx = distributed.init(device)
    if not ctx.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        tr = setup.build(cfg, model_cfg, seed, Path(shards_dir), Path(spm_model), ctx, hooks or faults.from_env())
        state, run_id, saved_world = setup.resume(tr, Path(run_dir))
        resumed_from = state.step if saved_world is not None else None
        log.info("training on %d process(es) (%s), %d micro-batches of <= %d tokens per epoch, accumulation %d",
                 ctx.world_size, ctx.device, len(tr.batches), cfg.max_tokens, tr.accum)
        tracker = tracking.current()
        tracker.resume(run_id)  # a resumed run continues its MLflow run: curves without gaps or duplicates
        tracker.queue_params({"model.vocab_size": tr.model.cfg.vocab_size})
        tracker.set_tags({"world_size": ctx.world_size, "accumulation": tr.accum, "device": ctx.device.type})
        fit(tr, state, run_dir=Path(run_dir), tracker=tracker)
        metrics = _finish(tr, state, run_dir=Path(run_dir), tracker=tracker, wall=time.monotonic() - wall0,
                          resumed_from=resumed_from)
        if ctx.is_main:
            write_text(plots_path, history_csv(state.history))
        return metrics
    finally:
        distributed.shutdown()
