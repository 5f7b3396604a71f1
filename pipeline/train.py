"""Stage ``train``: the Transformer on token-budget batches, on one or many processes (torchrun).

``python -m pipeline.launch`` starts ``torchrun -m pipeline.train``; run alone, this module trains
in a single process. Each optimizer step runs ``A = ceil(tokens_per_step / (world × max_tokens))``
micro-batches per rank; before each one the global torch (and CUDA) generators are reseeded from
(seed, epoch, global micro-batch index), so dropout does not depend on which rank ran it. Losses
are sums; after accumulation the gradients are summed over ranks and divided by the step's
global number of non-pad target tokens, so the update does not depend on how the tokens fell
into micro-batches or ranks. A relaunch resumes from the newest complete checkpoint.

A pre-flight on the plan's largest micro-batch shapes fails fast when memory is short; a later
out-of-memory error skips that optimizer step on every rank and is counted (:mod:`pipeline.preflight`).

Environment: ``NMT_THREADS`` (torch CPU threads), ``NMT_DEVICE`` (``cpu`` forces CPU),
``NMT_DIST_TIMEOUT_S`` (collective timeout, :mod:`pipeline.distributed`), ``NMT_FAULT_POINT`` /
``NMT_FAULT_ONCE`` (fault-injection test hooks, :mod:`pipeline.faults`).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import io
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import torch

from model import Transformer, TransformerConfig, inverse_sqrt_lr, label_smoothed_nll_loss
from pipeline import batching, checkpoint, distributed, faults, preflight, tracking
from pipeline.checkpoint import Progress
from pipeline.config import ModelConfig, Params, TrainConfig, flatten, section_dict
from pipeline.data import ShardSet
from pipeline.errors import DataError, PipelineError
from pipeline.stage import run_cli, stage_parser, write_metrics
from pipeline.textio import write_text

log = logging.getLogger(__name__)

PEAK_FLOPS = 989e12  # H100 SXM dense bf16, the MFU denominator (notes/anchors-nmt.md §2.4)
CSV_COLUMNS = ("step", "epoch", "train_loss", "train_nll", "train_ppl", "valid_loss", "valid_nll", "valid_ppl",
               "lr", "grad_norm", "tgt_tokens_per_step")


@dataclass
class Run:
    """Everything the loop needs, built once by :func:`stage`."""

    cfg: TrainConfig
    seed: int
    ctx: distributed.DistContext
    model: Transformer
    optim: torch.optim.Optimizer
    train: ShardSet
    valid: ShardSet
    batches: list[np.ndarray]
    valid_batches: list[np.ndarray]
    accum: int
    config: dict[str, Any]
    shards_sha256: str
    flops_per_token: float


def vocab_size(spm_model: Path) -> int:
    """Piece count of the SentencePiece model (the vocabulary size)."""
    if not Path(spm_model).is_file():
        raise DataError(f"{spm_model}: BPE model not found; run the bpe stage first (dvc repro bpe)")
    return spm.SentencePieceProcessor(model_file=str(spm_model)).get_piece_size()


def micro_seed(seed: int, epoch: int, index: int) -> int:
    """The torch seed of global micro-batch ``index`` of ``epoch``."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


def train_flops_per_target_token(cfg: TransformerConfig, src_len: float, tgt_len: float) -> float:
    """Matmul FLOPs of one training step per target token (notes/anchors-nmt.md §2.4, 3 × forward).

    ``src_len``/``tgt_len`` are mean sequence lengths (with EOS/BOS); source terms are scaled by
    source tokens per target token.
    """
    d, f, n, v = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    per_src = n * (8 * d * d + 4 * d * f + 4 * src_len * d) + n * 4 * d * d
    per_tgt = n * (12 * d * d + 4 * d * f + 4 * tgt_len * d + 4 * src_len * d) + 2 * d * v
    return 3.0 * (per_src * src_len / tgt_len + per_tgt)


def _setup(cfg: TrainConfig, model_cfg: ModelConfig, seed: int, shards_dir: Path, spm_model: Path,
           ctx: distributed.DistContext) -> Run:
    train, valid = ShardSet(shards_dir, "train"), ShardSet(shards_dir, "valid")
    train.check_spm(spm_model)
    tcfg = TransformerConfig(vocab_size=vocab_size(spm_model), **section_dict(model_cfg))
    ids, src_len, tgt_len = train.lengths()
    if len(ids) == 0:
        raise DataError(f"{shards_dir}: the train split is empty; check the clean/encode stages' metrics")
    batches = batching.plan_batches(ids, batching.token_lengths(src_len, tgt_len), max_tokens=cfg.max_tokens,
                                    seed=seed)
    v_ids, v_src, v_tgt = valid.lengths()
    valid_batches = batching.valid_plan(v_ids, batching.token_lengths(v_src, v_tgt), max_tokens=cfg.max_tokens,
                                        max_positions=tcfg.max_positions)
    torch.manual_seed(seed)  # identical initial weights on every rank and device
    model = Transformer(tcfg).to(ctx.device)
    preflight.check(model, preflight.largest_shapes(batches, ids, batching.token_lengths(src_len, tgt_len)),
                    device=ctx.device, max_tokens=cfg.max_tokens, label_smoothing=cfg.label_smoothing, rank=ctx.rank)
    fused = {"fused": True} if ctx.device.type == "cuda" else {}
    optim = torch.optim.Adam(model.parameters(), lr=0.0, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay, **fused)
    sha = hashlib.sha256((Path(shards_dir) / "manifest.json").read_bytes()).hexdigest()
    flops = train_flops_per_target_token(tcfg, float(src_len.mean()) + 1, float(tgt_len.mean()) + 1)
    return Run(cfg=cfg, seed=seed, ctx=ctx, model=model, optim=optim, train=train, valid=valid, batches=batches,
               valid_batches=valid_batches, accum=batching.accumulation(cfg.tokens_per_step, ctx.world_size,
                                                                        cfg.max_tokens),
               config={"model": tcfg.to_dict(), "train": section_dict(cfg), "seed": seed}, shards_sha256=sha,
               flops_per_token=flops)


def _resume(run: Run, run_dir: Path) -> tuple[Progress, str | None, int | None]:
    """Load the newest complete checkpoint (if any); returns progress, MLflow run id, its world size."""
    if run.ctx.is_main:  # a run killed while saving: drop the half-written folder, finish the pruning
        checkpoint.clean_incomplete(run_dir)
        checkpoint.prune(run_dir, run.cfg.keep_last)
    distributed.barrier()
    folder = checkpoint.latest(run_dir)
    if folder is None:
        return Progress(), None, None
    state = checkpoint.read_state(folder)
    checkpoint.check_resumable(folder, state, config=run.config, shards_sha256=run.shards_sha256)
    run.model.load_state_dict(checkpoint.load_tensors(folder, checkpoint.MODEL))
    run.optim.load_state_dict(checkpoint.load_tensors(folder, checkpoint.OPTIM))
    if state["world_size"] != run.ctx.world_size:
        log.warning("resuming %s saved by %d processes on %d: the run continues from the same micro-batch but "
                    "is no longer bitwise equal to an uninterrupted one", folder, state["world_size"],
                    run.ctx.world_size)
    log.info("resuming from %s (step %d, epoch %d, micro-batch %d)", folder, state["step"], state["epoch"],
             state["micro_batch"])
    progress = Progress.from_state(state)
    return progress, state.get("mlflow_run_id"), state["world_size"]


def _epoch_steps(run: Run, progress: Progress):
    cfg = run.model.cfg
    return batching.epoch_steps(run.batches, run.train.fetch, seed=run.seed, epoch=progress.epoch,
                                start=progress.micro, rank=run.ctx.rank, world_size=run.ctx.world_size,
                                accum=run.accum, pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id,
                                pin=run.ctx.device.type == "cuda")


def _accumulate(run: Run, micro_batches: list, progress: Progress, step: int) -> tuple[torch.Tensor, str | None]:
    """Forward+backward of this rank's micro-batches.

    Returns:
        [4] float64 ``loss_sum, nll_sum, non-pad target tokens, ran out of memory (0/1)``, and the
        shape of the micro-batch that ran out of memory (None if none did; the rest are not run).
    """
    model, dev, rank = run.model, run.ctx.device, run.ctx.rank
    sums, tokens = torch.zeros(2, dtype=torch.float64, device=dev), 0  # loss_sum, nll_sum; non-pad target tokens
    oom = None
    for i, batch in enumerate(micro_batches):
        if batch is None:
            continue
        torch.manual_seed(micro_seed(run.seed, progress.epoch, batch.index))
        b = batch.to(dev)
        try:
            faults.hit("forward", step, rank)
            with preflight.autocast(dev):
                logits = model(b.src, b.tgt_in)
            loss_sum, nll_sum = label_smoothed_nll_loss(logits, b.tgt_out, epsilon=run.cfg.label_smoothing,
                                                        ignore_index=model.cfg.pad_id)
            loss_sum.backward()
        except torch.OutOfMemoryError:
            oom = f"micro-batch {batch.index}: src {list(b.src.shape)}, tgt {list(b.tgt_in.shape)}"
            break
        sums += torch.stack([loss_sum.detach(), nll_sum.detach()]).double()
        tokens += b.n_tokens
        if i + 1 < len(micro_batches):
            faults.hit("mid_accum", step, rank)
    return torch.cat([sums, torch.tensor([float(tokens), float(oom is not None)], dtype=torch.float64,
                                         device=dev)]), oom


def _train_step(run: Run, micro_batches: list, progress: Progress) -> dict[str, float] | None:
    """One optimizer step over this rank's micro-batches; returns global step statistics.

    Returns None when a rank ran out of memory: every rank then skips the step (the OOM flag
    travels with the step's statistics, so the ranks stay in lockstep).
    """
    model, dev, step = run.model, run.ctx.device, progress.step + 1
    stats, oom = _accumulate(run, micro_batches, progress, step)
    faults.hit("collective", step, run.ctx.rank)
    distributed.all_reduce_sum(stats)  # the global loss sums, non-pad target tokens and OOM ranks of this step
    loss_sum, nll_sum, tokens, oom_ranks = stats.tolist()
    if oom_ranks:
        model.zero_grad(set_to_none=True)
        preflight.skip_step(progress, oom, rank=run.ctx.rank, device=dev)
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    distributed.all_reduce_grads(params)
    grads = [p.grad for p in params]
    torch._foreach_div_(grads, tokens)
    norm = torch.nn.utils.get_total_norm(grads)
    if run.cfg.clip_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, run.cfg.clip_norm, norm)
    norm = float(norm)
    if not (math.isfinite(loss_sum) and math.isfinite(norm)):
        raise PipelineError(
            f"train step {step}: non-finite {'loss' if not math.isfinite(loss_sum) else 'gradient norm'} "
            f"(loss sum {loss_sum}, grad norm {norm}); the optimizer step was not taken. Lower train.lr_scale, "
            "set train.clip_norm (e.g. 1.0) or check the data, then move paths.train away and retrain "
            "(checkpoints resume only under the configuration that wrote them).")
    lr = inverse_sqrt_lr(step, model.cfg.d_model, run.cfg.warmup_steps, run.cfg.lr_scale)
    for group in run.optim.param_groups:
        group["lr"] = lr
    run.optim.step()
    run.optim.zero_grad(set_to_none=True)
    return {"loss_sum": loss_sum, "nll_sum": nll_sum, "tokens": tokens, "lr": lr, "grad_norm": norm}


@torch.no_grad()
def validate(run: Run) -> dict[str, float]:
    """Loss per token, NLL per token and perplexity on the valid split (split over ranks)."""
    model, dev, cfg = run.model, run.ctx.device, run.model.cfg
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=dev)
    for ids in run.valid_batches[run.ctx.rank::run.ctx.world_size]:
        b = batching.collate(run.valid.fetch(ids), pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id).to(dev)
        with preflight.autocast(dev):
            logits = model(b.src, b.tgt_in)
        loss_sum, nll_sum = label_smoothed_nll_loss(logits, b.tgt_out, epsilon=run.cfg.label_smoothing,
                                                    ignore_index=cfg.pad_id)
        stats += torch.tensor([float(loss_sum), float(nll_sum), float(b.n_tokens)], dtype=torch.float64,
                              device=dev)
    model.train()
    loss_sum, nll_sum, tokens = distributed.all_reduce_sum(stats).tolist()
    tokens = max(tokens, 1.0)
    return {"valid_loss": loss_sum / tokens, "valid_nll": nll_sum / tokens,
            "valid_ppl": math.exp(min(nll_sum / tokens, 700.0))}


def _save(run: Run, progress: Progress, run_dir: Path, run_id: str | None) -> None:
    if run.ctx.is_main:
        state = progress.state(world_size=run.ctx.world_size, config=run.config, shards_sha256=run.shards_sha256,
                               mlflow_run_id=run_id)
        folder = checkpoint.save(run_dir, progress.step, model_state=run.model.state_dict(),
                                 optim_state=run.optim.state_dict(), state=state, keep_last=run.cfg.keep_last)
        log.info("checkpoint %s", folder)
    distributed.barrier()


class _Interval:
    """Sums over the steps since the last log line."""

    def __init__(self) -> None:
        self.loss = self.nll = self.tokens = 0.0
        self.steps = 0
        self.start = time.monotonic()

    def add(self, s: dict[str, float]) -> None:
        self.loss += s["loss_sum"]
        self.nll += s["nll_sum"]
        self.tokens += s["tokens"]
        self.steps += 1


def _log_interval(run: Run, progress: Progress, iv: _Interval, last: dict[str, float], tracker, t0: float,
                  start_step: int) -> dict[str, Any]:
    elapsed = max(time.monotonic() - iv.start, 1e-9)
    tok = max(iv.tokens, 1.0)
    row = {"step": progress.step, "epoch": progress.epoch, "train_loss": iv.loss / tok, "train_nll": iv.nll / tok,
           "train_ppl": math.exp(min(iv.nll / tok, 700.0)), "lr": last["lr"], "grad_norm": last["grad_norm"],
           "tgt_tokens_per_step": iv.tokens / iv.steps}
    rate = iv.tokens / elapsed
    extra = {"tgt_tokens_per_s": rate}
    if run.ctx.device.type == "cuda":
        extra["mfu"] = rate * run.flops_per_token / (PEAK_FLOPS * run.ctx.world_size)
    per_step = (time.monotonic() - t0) / max(progress.step - start_step, 1)
    eta = per_step * (run.cfg.max_steps - progress.step)
    if run.cfg.max_minutes > 0:
        eta = min(eta, max(0.0, run.cfg.max_minutes * 60 - (time.monotonic() - t0)))
    log.info("step %d/%d epoch %d | loss %.4f nll %.4f ppl %.2f | lr %.3g | gnorm %.3f | %.0f tgt tok/s%s | "
             "%.0f tok/step | ETA %s", progress.step, run.cfg.max_steps, progress.epoch, row["train_loss"],
             row["train_nll"], row["train_ppl"], row["lr"], row["grad_norm"], rate,
             f" | MFU {extra['mfu']:.1%}" if "mfu" in extra else "", row["tgt_tokens_per_step"],
             time.strftime("%H:%M:%S", time.gmtime(eta)) if eta < 86400 else f"{eta / 3600:.1f} h")
    tracker.log_metrics({k: v for k, v in {**row, **extra}.items() if k not in ("step", "epoch")}, step=progress.step)
    return row


def _should_stop(run: Run, progress: Progress, t0: float, *, timed: bool = True) -> bool:
    """Whether a limit is reached; the time limit (agreed over ranks) only when ``timed``."""
    cfg = run.cfg
    if progress.step >= cfg.max_steps or (cfg.max_epochs and progress.epoch >= cfg.max_epochs):
        return True
    if timed and cfg.max_minutes > 0:
        elapsed = torch.tensor([time.monotonic() - t0], dtype=torch.float64, device=run.ctx.device)
        return float(distributed.all_reduce_max(elapsed)) >= cfg.max_minutes * 60
    return False


def fit(run: Run, progress: Progress, *, run_dir: Path, tracker) -> None:
    """Train until max_steps, max_epochs or max_minutes; validate, log and checkpoint on the way."""
    clock = _Clock(t0=time.monotonic(), start_step=progress.step)
    run.model.train()
    while not _should_stop(run, progress, clock.t0, timed=False):  # time is checked after each step
        with contextlib.closing(_epoch_steps(run, progress)) as steps:
            for micro_batches in steps:
                _one_step(run, progress, micro_batches, run_dir=run_dir, tracker=tracker, clock=clock)
                if _should_stop(run, progress, clock.t0):
                    return


@dataclass
class _Clock:
    t0: float
    start_step: int
    interval: _Interval = field(default_factory=lambda: _Interval())


def _one_step(run: Run, progress: Progress, micro_batches: list, *, run_dir: Path, tracker, clock: _Clock) -> None:
    cfg = run.cfg
    step_start = time.monotonic()
    stats = _train_step(run, micro_batches, progress)
    progress.micro += run.ctx.world_size * run.accum
    if progress.micro >= len(run.batches):  # the epoch's last step (its generator is exhausted)
        progress.epoch, progress.micro = progress.epoch + 1, 0
    if stats is None:  # skipped for lack of memory
        return
    progress.oom_streak = 0
    progress.step += 1
    progress.tokens_seen += int(stats["tokens"])
    progress.train_seconds += time.monotonic() - step_start
    clock.interval.add(stats)
    if progress.step % cfg.log_every_steps == 0:
        progress.history.append(_log_interval(run, progress, clock.interval, stats, tracker, clock.t0,
                                              clock.start_step))
        clock.interval = _Interval()
    if progress.step % cfg.valid_every_steps == 0:
        _record_valid(run, progress, tracker)
    if progress.step % cfg.save_every_steps == 0:
        _save(run, progress, run_dir, tracker.run_id)
    faults.hit("after_step", progress.step, run.ctx.rank)

def _record_valid(run: Run, progress: Progress, tracker) -> dict[str, float]:
    scores = validate(run)
    log.info("step %d valid | loss %.4f nll %.4f ppl %.2f", progress.step, scores["valid_loss"],
             scores["valid_nll"], scores["valid_ppl"])
    tracker.log_metrics(scores, step=progress.step)
    progress.history.append({"step": progress.step, "epoch": progress.epoch, **scores})
    return scores


def _csv(history: list[dict[str, Any]]) -> str:
    rows: dict[int, dict[str, Any]] = {}
    for entry in history:
        rows.setdefault(entry["step"], {}).update(entry)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for step in sorted(rows):
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in rows[step].items()})
    return out.getvalue()


def _finish(run: Run, progress: Progress, *, run_dir: Path, metrics_path: Path, plots_path: Path, tracker,
            wall: float, resumed_from: int | None) -> dict[str, Any]:
    last_valid = next((h for h in reversed(progress.history) if "valid_loss" in h), None)
    if last_valid is None or last_valid["step"] != progress.step:
        last_valid = _record_valid(run, progress, tracker)
    _save(run, progress, run_dir, tracker.run_id)
    last_train = next((h for h in reversed(progress.history) if "train_loss" in h), {})
    metrics = {"step": progress.step, "epoch": progress.epoch, "tokens_seen": progress.tokens_seen,
               "world_size": run.ctx.world_size, "accumulation": run.accum, "micro_batches": len(run.batches),
               **{k: v for k, v in last_train.items() if k.startswith("train_")},
               **{k: v for k, v in last_valid.items() if k.startswith("valid_")},
               "train_seconds": round(progress.train_seconds, 3), "wall_seconds": round(wall, 3),
               "tgt_tokens_per_s": progress.tokens_seen / max(progress.train_seconds, 1e-9),
               "resumed_from_step": resumed_from, "oom_skipped_steps": progress.oom_skipped,
               "mlflow_run_id": tracker.run_id, "device": run.ctx.device.type,
               "device_name": torch.cuda.get_device_name(run.ctx.device) if run.ctx.device.type == "cuda" else "cpu"}
    if run.ctx.is_main:
        write_metrics(metrics_path, metrics)
        write_text(plots_path, _csv(progress.history))
    return metrics


def stage(cfg: TrainConfig, *, model_cfg: ModelConfig, seed: int, shards_dir: str | Path, spm_model: str | Path,
          run_dir: str | Path, metrics_path: str | Path, plots_path: str | Path, root: str | Path = ".") -> dict:
    """Train (or resume) the Transformer; every rank of a torchrun job calls this.

    Args:
        cfg: the ``train`` section.
        model_cfg: the ``model`` section (the vocabulary size comes from ``spm_model``).
        seed: the global seed (weights, batch order, dropout).
        shards_dir: the encode stage's output (manifest.json + train/valid shards).
        spm_model: the BPE model the shards were encoded with.
        run_dir: the checkpoint folder (``<paths.train>``; persistent, resumable).
        metrics_path: ``train.json`` with final values, timings and the MLflow run id.
        plots_path: ``train.csv`` with one row per logged step.

    Returns:
        The metrics written to ``metrics_path``.
    """
    wall0 = time.monotonic()
    ctx = distributed.init(os.environ.get("NMT_DEVICE") or None)
    if not ctx.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        run = _setup(cfg, model_cfg, seed, Path(shards_dir), Path(spm_model), ctx)
        progress, run_id, saved_world = _resume(run, Path(run_dir))
        resumed_from = progress.step if saved_world is not None else None
        log.info("training on %d process(es) (%s), %d micro-batches of <= %d tokens per epoch, accumulation %d",
                 ctx.world_size, ctx.device, len(run.batches), cfg.max_tokens, run.accum)
        with tracking.stage_run("train", root=root, resume_run_id=run_id, active=ctx.is_main) as tracker:
            if run_id is None:
                tracker.log_params(flatten(run.config))
            tracker.set_tags({"world_size": ctx.world_size, "accumulation": run.accum, "device": ctx.device.type})
            fit(run, progress, run_dir=Path(run_dir), tracker=tracker)
            return _finish(run, progress, run_dir=Path(run_dir), metrics_path=Path(metrics_path),
                           plots_path=Path(plots_path), tracker=tracker, wall=time.monotonic() - wall0,
                           resumed_from=resumed_from)
    finally:
        distributed.shutdown()


def _body(params: Params, args: argparse.Namespace) -> None:
    threads = os.environ.get("NMT_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    paths = params.paths
    stage(params.train, model_cfg=params.model, seed=params.seed, shards_dir=paths.shards,
          spm_model=Path(paths.bpe) / "spm.model", run_dir=paths.train,
          metrics_path=Path(paths.metrics) / "train.json", plots_path=Path(paths.plots) / "train.csv")


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m pipeline.train [--params params.yaml]`` (normally under torchrun via pipeline.launch)."""
    return run_cli("train", _body, argv, stage_parser("train the Transformer (resumes from the newest checkpoint)"))


if __name__ == "__main__":
    sys.exit(main())
