"""The training loop: the Transformer on global batches, on one or many processes (torchrun).

Each optimizer step (:func:`train_step`) trains one global batch, the same pairs whatever the number of processes;
gradients are summed (over ranks by ``DistributedDataParallel`` in the step's last pass) and divided by the step's
global non-pad target tokens, so the update does not depend on how pairs fell into passes or ranks.
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

from model import TransformerConfig, autocast, inverse_sqrt_lr
from pipeline import tracking
from pipeline.artifacts import checkpoint
from pipeline.core.config import TrainConfig
from pipeline.core.details import Machine, TrainDetails
from pipeline.core.errors import PipelineError
from pipeline.core.owned import write_text
from pipeline.data import batching
from pipeline.training import distributed, faults, pause, preflight, setup
from pipeline.training.logs import PEAK_FLOPS, StepStats, TrainLog, history_csv, log_valid, perplexity
from pipeline.training.setup import Trainer
from pipeline.training.state import TrainState

log = logging.getLogger(__name__)


def forward_seed(seed: int, epoch: int, position: int, rank: int, forward: int) -> int:
    """The torch seed of one forward pass: (seed, epoch, step of the epoch, rank, pass on that rank)."""
    entropy = [seed, epoch, position, rank, forward]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)


def train_step(tr: Trainer, passes: list[batching.Batch], state: TrainState) -> StepStats | None:
    """One optimizer step on this rank's share ``passes`` of the global batch (possibly empty).
    None when a rank ran out of memory (every rank then skips the step).

    With one CUDA process (:func:`on_device`) the step never waits for the GPU: ``loss_sum``, ``nll_sum`` and
    ``grad_norm`` come back as device scalars, with ``nonfinite``; fused Adam skips a non-finite step on the device
    (``found_inf``, as under ``torch.amp.GradScaler``) and :func:`settle` raises for it at the next read.

    Raises:
        PipelineError: a non-finite loss or gradient norm (the step is not taken), read at once where not on device.
    """
    model, dev, rank, step = tr.model, tr.ctx.device, tr.ctx.rank, state.step + 1
    sums, tokens, src, oom = torch.zeros(2, dtype=torch.float64, device=dev), 0, 0, None  # loss_sum, nll_sum
    for i, batch in enumerate(passes):  # 1. forward + backward of this rank's share (sums) ...
        torch.manual_seed(forward_seed(tr.seed, state.epoch, batch.index, rank, batch.forward))
        b, last = batch.to(dev), i + 1 == len(passes)
        try:
            tr.hooks.at("forward", step, rank)
            with distributed.grad_sync(tr.pass_loss, last):  # ... the last one sums the gradients over ranks
                with autocast(dev):
                    loss_sum, nll_sum = tr.pass_loss(b.src, b.tgt_in, b.tgt_out, tr.cfg.label_smoothing)
                if last:
                    distributed.synced_backward(loss_sum)
                else:
                    loss_sum.backward()
        except torch.OutOfMemoryError:
            oom = f"forward pass {batch.forward}: src {list(b.src.shape)}, tgt {list(b.tgt_in.shape)}"
            break
        sums += torch.stack([loss_sum.detach(), nll_sum.detach()]).double()
        tokens, src = tokens + b.n_tokens, src + b.n_src
        if not last:
            tr.hooks.at("mid_accum", step, rank)
    if tr.ctx.world_size > 1 and (oom or not passes):
        _idle_pass(tr)
    if on_device(tr) and oom is None:  # one process: its sums are the global ones, nothing to agree on
        return _update(tr, step, sums[0], sums[1], float(tokens), float(len(passes)), src)
    stats = torch.cat([sums, torch.tensor([tokens, oom is not None, src], dtype=torch.float64, device=dev)])
    tr.hooks.at("collective", step, rank)
    distributed.all_reduce_sum(stats)  # 2. the global loss sums, non-pad target tokens, OOM ranks, source tokens
    loss_sum, nll_sum, tokens, oom_ranks, src = stats.tolist()
    forwards = float(distributed.all_reduce_max(torch.tensor([float(len(passes))], dtype=torch.float64, device=dev)))
    if oom_ranks:
        model.zero_grad(set_to_none=True)
        preflight.skip_step(state, oom, rank=rank, device=dev)
        return None
    stats = _update(tr, step, loss_sum, nll_sum, tokens, forwards, src)
    settle([(step, stats)])  # 5. finite check, before the next step
    return stats


def _idle_pass(tr: Trainer) -> None:
    """A zero-loss pass of one token, so a rank with nothing (more) to train joins its peers' gradient all-reduce.
    An out-of-memory error inside the last pass's own backward leaves DDP mid-reduction: that step is not recovered.
    """
    cfg, dev = tr.model.cfg, tr.ctx.device
    src, tgt_in, tgt_out = (torch.full((1, 1), i, dtype=torch.long, device=dev)
                            for i in (cfg.eos_id, cfg.bos_id, cfg.eos_id))
    with autocast(dev):
        loss_sum, _ = tr.pass_loss(src, tgt_in, tgt_out, tr.cfg.label_smoothing)
    distributed.synced_backward(loss_sum * 0.0)


def on_device(tr: Trainer) -> bool:
    """Whether steps stay on the device: one process whose Adam is fused (CUDA), so it can skip a step itself."""
    return tr.ctx.world_size == 1 and bool(tr.optim.defaults.get("fused"))


def _update(tr: Trainer, step: int, loss_sum: Any, nll_sum: Any, tokens: float, forwards: float,
            src: float) -> StepStats:
    """Steps 3-7 of :func:`train_step`: gradient sums over ranks / ``tokens``, clipping, the lr, Adam."""
    params = [p for p in tr.model.parameters() if p.requires_grad]
    for p in params:  # 3. gradient sums over ranks (DDP's all-reduce, in the last pass) ...
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    torch._foreach_div_(grads, tokens)  # ... divided by the step's global non-pad target tokens
    norm = torch.nn.utils.get_total_norm(grads)
    if tr.cfg.clip_norm > 0:  # 4. clip (the paper does not)
        torch.nn.utils.clip_grads_with_norm_(params, tr.cfg.clip_norm, norm)
    stats = StepStats(loss_sum=loss_sum, nll_sum=nll_sum, tokens=tokens, forwards=forwards, grad_norm=norm,
                      src_tokens=src)
    if on_device(tr):
        stats["nonfinite"] = ~(torch.isfinite(loss_sum) & torch.isfinite(norm))
        tr.optim.found_inf = stats["nonfinite"].float()  # fused Adam leaves params, moments and step count alone
    else:
        stats["grad_norm"] = grad_norm = float(norm)
        stats["nonfinite"] = not (math.isfinite(loss_sum) and math.isfinite(grad_norm))
        if stats["nonfinite"]:
            return stats  # settle raises; the update is not taken
    lr = inverse_sqrt_lr(step, tr.model.cfg.d_model, tr.cfg.warmup_steps, tr.cfg.lr_scale)  # 6. learning rate
    for group in tr.optim.param_groups:
        group["lr"] = lr
    tr.optim.step()  # 7. Adam step
    tr.optim.found_inf = None
    tr.optim.zero_grad(set_to_none=True)
    stats["lr"] = lr
    return stats


def settle(steps: list[tuple[int, StepStats]]) -> None:
    """Turn the steps' device scalars into floats, in place, with one host sync; raise at the first non-finite step.

    Raises:
        PipelineError: the step's loss or gradient norm is not finite; its optimizer step was not taken.
    """
    live = [s for _, s in steps if torch.is_tensor(s["grad_norm"])]
    if live:
        keys = ("loss_sum", "nll_sum", "grad_norm", "nonfinite")
        values = torch.stack([torch.stack([s[k].double() for k in keys]) for s in live]).tolist()
        for s, (loss_sum, nll_sum, grad_norm, nonfinite) in zip(live, values):
            s.update(loss_sum=loss_sum, nll_sum=nll_sum, grad_norm=grad_norm, nonfinite=bool(nonfinite))
    for step, s in steps:
        if s["nonfinite"]:
            what = "loss" if not math.isfinite(s["loss_sum"]) else "gradient norm"
            raise PipelineError(
                f"train step {step}: non-finite {what} (loss sum {s['loss_sum']}, grad norm {s['grad_norm']}); the "
                "optimizer step was not taken. Lower train.lr_scale, set train.clip_norm (e.g. 1.0) or check the "
                "data, then move paths.train away and retrain (checkpoints resume only under the configuration "
                "that wrote them).")


@torch.no_grad()
def validate(tr: Trainer) -> dict[str, float]:
    """Loss per token, NLL per token and perplexity on the valid split (split over ranks)."""
    model, dev, cfg = tr.model, tr.ctx.device, tr.model.cfg
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=dev)
    for ids in tr.valid_batches[tr.ctx.rank::tr.ctx.world_size]:
        b = batching.collate(tr.valid.fetch(ids), pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id).to(dev)
        with autocast(dev):
            loss_sum, nll_sum = tr.loss(model, b.src, b.tgt_in, b.tgt_out, tr.cfg.label_smoothing)
        stats += torch.tensor([float(loss_sum), float(nll_sum), float(b.n_tokens)], dtype=torch.float64, device=dev)
    model.train()
    loss_sum, nll_sum, tokens = distributed.all_reduce_sum(stats).tolist()
    tokens = max(tokens, 1.0)
    return {"valid_loss": loss_sum / tokens, "valid_nll": nll_sum / tokens, "valid_ppl": perplexity(nll_sum / tokens)}


def _finished(tr: Trainer, state: TrainState) -> bool:
    """Whether ``train.max_steps`` or ``train.max_epochs`` is reached (the run's end)."""
    return state.step >= tr.cfg.max_steps or bool(tr.cfg.max_epochs and state.epoch >= tr.cfg.max_epochs)


def _out_of_time(tr: Trainer, elapsed: float) -> bool:
    """Whether ``train.max_minutes`` (> 0) is used up on any rank (agreed over ranks)."""
    if tr.cfg.max_minutes <= 0:
        return False
    if tr.ctx.world_size == 1:  # nothing to agree on: no round trip to the device
        return elapsed >= tr.cfg.max_minutes * 60
    seconds = torch.tensor([elapsed], dtype=torch.float64, device=tr.ctx.device)
    return float(distributed.all_reduce_max(seconds)) >= tr.cfg.max_minutes * 60


def fit(tr: Trainer, state: TrainState, *, run_dir: Path, tracker: Any) -> bool:
    """Train until max_steps or max_epochs; False when ``train.max_minutes`` paused the run first."""
    cfg, model_cfg = tr.cfg, tr.model.cfg
    peak = PEAK_FLOPS * tr.ctx.world_size if tr.ctx.device.type == "cuda" else 0.0
    logs = TrainLog(tracker, max_steps=cfg.max_steps, max_minutes=cfg.max_minutes,
                    flops_per_token=tr.flops_per_token, peak_flops=peak, start_step=state.step,
                    sums=state.interval)
    tr.model.train()
    # Steps whose figures are still on the device: read at log, validation and save steps and at the end
    unread: list[tuple[int, StepStats]] = []
    every = (cfg.log_every_steps, cfg.valid_every_steps, cfg.save_every_steps)
    while not _finished(tr, state):  # time is checked after each step
        steps = batching.epoch_steps(tr.plan, tr.train.fetch, seed=tr.seed, epoch=state.epoch, start=state.position,
                                     rank=tr.ctx.rank, world_size=tr.ctx.world_size, max_tokens=tr.max_tokens,
                                     pad_id=model_cfg.pad_id, bos_id=model_cfg.bos_id, eos_id=model_cfg.eos_id,
                                     pin=tr.ctx.device.type == "cuda")
        with contextlib.closing(steps):
            for passes in steps:
                started = time.monotonic()
                stats = train_step(tr, passes, state)
                state.advance(len(tr.plan))
                if stats is not None:  # None: skipped for lack of memory
                    state.oom_streak = 0
                    state.count(int(stats["tokens"]), int(stats["forwards"]), int(stats["src_tokens"]))
                    unread.append((state.step, stats))
                    if not on_device(tr) or logs.quiet() or any(state.step % n == 0 for n in every):
                        _read(unread, logs)  # waits for the device: counted in this step's time
                    state.train_seconds += time.monotonic() - started
                    if logs.quiet() and state.step % cfg.log_every_steps:
                        logs.progress(state)
                    _after_step(tr, state, stats, logs, run_dir=run_dir, tracker=tracker)
                if _finished(tr, state):
                    break
                if _out_of_time(tr, logs.elapsed()):
                    _read(unread, logs)
                    log.info("training paused: train.max_minutes=%g used up at step %d of train.max_steps=%d; "
                             "rerun the stage to resume", cfg.max_minutes, state.step, cfg.max_steps)
                    return False
    _read(unread, logs)
    limit = "max_steps" if state.step >= cfg.max_steps else "max_epochs"
    log.info("training stopped: reached train.%s=%d at step %d", limit, getattr(cfg, limit), state.step)
    return True


def _read(unread: list[tuple[int, StepStats]], logs: TrainLog) -> None:
    """:func:`settle` the unread steps and add them to the log interval."""
    settle(unread)
    for _, stats in unread:
        logs.add(stats)
    unread.clear()


def _after_step(tr: Trainer, state: TrainState, stats: StepStats, logs: TrainLog, *, run_dir: Path,
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
            resumed_from: int | None) -> TrainDetails:
    """Validate and checkpoint the last step (unless just done); the stage's summary."""
    last_valid = next((h for h in reversed(state.history) if "valid_loss" in h), None)
    if last_valid is None or last_valid["step"] != state.step:
        log_valid(tracker, state, validate(tr))
        last_valid = state.history[-1]
    setup.save(tr, state, run_dir, tracker.run_id)
    last_train = next((h for h in reversed(state.history) if "train_loss" in h), {})
    dev = tr.ctx.device
    return TrainDetails(
        step=state.step, tokens_seen=state.tokens_seen, world_size=tr.ctx.world_size, **state.batch_stats(),
        device=dev.type, device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        wall_seconds=round(wall, 3), train_seconds=round(state.train_seconds, 3), resumed_from_step=resumed_from,
        valid_ppl=last_valid["valid_ppl"], machine=Machine.here(), folder=str(run_dir),
        checkpoints=checkpoint.digests(run_dir), epoch=state.epoch, max_tokens=tr.max_tokens,
        global_batches=len(tr.plan), train_loss=last_train.get("train_loss"), train_nll=last_train.get("train_nll"),
        train_ppl=last_train.get("train_ppl"), valid_loss=last_valid["valid_loss"], valid_nll=last_valid["valid_nll"],
        tgt_tokens_per_s=state.tokens_seen / max(state.train_seconds, 1e-9), oom_skipped_steps=state.oom_skipped)


def train(cfg: TrainConfig, *, model_cfg: TransformerConfig, seed: int, shards_dir: str | Path, spm_model: str | Path,
          run_dir: str | Path, plots_path: str | Path, device: str | None = None,
          hooks: faults.Hooks | None = None) -> TrainDetails:
    """Train (or resume) the Transformer in ``run_dir``; every rank of a torchrun job calls this."""
    wall0 = time.monotonic()
    ctx = distributed.init(device)
    if not ctx.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        pause.check_restart(run_dir, is_main=ctx.is_main)
        tr = setup.build(cfg, model_cfg, seed, Path(shards_dir), Path(spm_model), ctx, hooks or faults.from_env())
        state, run_id, saved_world = setup.resume(tr, Path(run_dir))
        resumed_from = state.step if saved_world is not None else None
        log.info("training on %d process(es) (%s): %d global batches of <= %d target tokens per epoch, forward "
                 "passes of <= %d padded tokens (NMT_MAX_TOKENS)", ctx.world_size, ctx.device, len(tr.plan),
                 cfg.tokens_per_step, tr.max_tokens)
        tracker = tracking.current()
        tracker.resume(run_id)  # a resumed run continues its MLflow run: curves without gaps or duplicates
        tracker.queue_params({"model.vocab_size": tr.model.cfg.vocab_size})
        tracker.set_tags({"world_size": ctx.world_size, "max_tokens": tr.max_tokens, "device": ctx.device.type})
        ended = fit(tr, state, run_dir=Path(run_dir), tracker=tracker)
        metrics = _finish(tr, state, run_dir=Path(run_dir), tracker=tracker, wall=time.monotonic() - wall0,
                          resumed_from=resumed_from)
        if ctx.is_main:
            write_text(plots_path, history_csv(state.history))
        if not ended:
            raise pause.pause(run_dir, max_minutes=cfg.max_minutes, step=state.step, max_steps=cfg.max_steps,
                              is_main=ctx.is_main)
        return metrics
    finally:
        distributed.shutdown()
