"""What training reports: progress lines, MLflow curves, the ``train.csv`` plot file, throughput and MFU
(model FLOPs utilisation: the matmul FLOPs of the trained tokens over the GPUs' dense bf16 peak).
"""

from __future__ import annotations

import csv
import io
import logging
import math
import time
from typing import TYPE_CHECKING, Any, TypedDict

from model import TransformerConfig
from pipeline.training.state import TrainState

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: A slow run prints a progress line at least this often, between its ``train.log_every_steps`` lines.
QUIET_SECONDS = 60.0
PEAK_FLOPS = 989e12  # H100 SXM dense bf16 (NVIDIA H100 datasheet), the MFU denominator
CSV_COLUMNS = ("step", "epoch", "train_loss", "train_nll", "train_ppl", "valid_loss", "valid_nll", "valid_ppl",
               "lr", "grad_norm", "tgt_tokens_per_step", "forwards_per_step")


class StepStats(TypedDict, total=False):
    """One optimizer step's global figures (pipeline/training/loop.py ``train_step``): device scalars on one CUDA
    process until ``settle`` reads them, then numbers."""

    loss_sum: float | torch.Tensor  # label-smoothed loss summed over the step's target tokens
    nll_sum: float | torch.Tensor
    tokens: float  # non-pad target tokens
    forwards: float  # forward passes of the busiest rank
    src_tokens: float
    grad_norm: float | torch.Tensor  # before clipping
    nonfinite: bool | torch.Tensor  # loss or gradient norm not finite: the update was not taken
    lr: float  # absent for a step not taken


def train_flops_per_target_token(cfg: TransformerConfig, src_len: float, tgt_len: float) -> float:
    """Matmul FLOPs of one training step per target token: 2 per multiply-add, training = 3 × forward.

    Counted layer by layer as in Chowdhery et al. 2022 (PaLM, arXiv:2204.02311, Appendix B); ``src_len``/``tgt_len``
    are mean sequence lengths (with EOS/BOS).
    """
    d, f, n, v = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    per_src = n * (8 * d * d + 4 * d * f + 4 * src_len * d) + n * 4 * d * d
    per_tgt = n * (12 * d * d + 4 * d * f + 4 * tgt_len * d + 4 * src_len * d) + 2 * d * v
    return 3.0 * (per_src * src_len / tgt_len + per_tgt)


def perplexity(nll_per_token: float) -> float:
    """exp(NLL), capped so that a diverged run still logs a number."""
    return math.exp(min(nll_per_token, 700.0))


class TrainLog:
    """Interval sums between log lines, and the line itself (stdout, MLflow, ``state.history``).

    ``peak_flops`` is 0 where MFU means nothing (CPU); ``sums`` is ``state.interval``, which checkpoints save.
    """

    KEYS = ("loss", "nll", "tokens", "forwards", "steps")

    def __init__(self, tracker: Any, *, max_steps: int, max_minutes: float, flops_per_token: float,
                 peak_flops: float, start_step: int, sums: dict[str, float]) -> None:
        self.tracker, self.max_steps, self.max_minutes = tracker, max_steps, max_minutes
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.t0 = time.monotonic()
        self.sums = sums
        for key in self.KEYS:
            self.sums.setdefault(key, 0.0)
        self.since, self.since_step = time.monotonic(), start_step
        self.since_tokens = self.sums["tokens"]  # throughput counts this process's steps only

    def add(self, stats: StepStats) -> None:
        """Add one optimizer step's global sums (``loss_sum``, ``nll_sum``, ``tokens``) and ``forwards``."""
        for key, stat in (("loss", "loss_sum"), ("nll", "nll_sum"), ("tokens", "tokens"), ("forwards", "forwards")):
            self.sums[key] += stats[stat]
        self.sums["steps"] += 1

    def elapsed(self) -> float:
        """Seconds since the run (re)started."""
        return time.monotonic() - self.t0

    def quiet(self) -> bool:
        """Whether :data:`QUIET_SECONDS` passed since the last line: time for a :meth:`progress` line."""
        return time.monotonic() - self.since >= QUIET_SECONDS

    def _rate_eta(self, state: TrainState) -> tuple[float, str]:
        """Target tokens/s since the last line, and the ETA at the pace of the steps since then."""
        seconds = max(time.monotonic() - self.since, 1e-9)
        rate = (self.sums["tokens"] - self.since_tokens) / seconds
        eta = seconds / max(state.step - self.since_step, 1) * (self.max_steps - state.step)
        if self.max_minutes > 0:
            eta = min(eta, max(0.0, self.max_minutes * 60 - self.elapsed()))
        self.since, self.since_step, self.since_tokens = time.monotonic(), state.step, self.sums["tokens"]
        return rate, time.strftime("%H:%M:%S", time.gmtime(eta)) if eta < 86400 else f"{eta / 3600:.1f} h"

    def progress(self, state: TrainState) -> None:
        """A line between ``log_every_steps`` lines on a slow run: the interval so far; no row, no MLflow metric."""
        tok = max(self.sums["tokens"], 1.0)
        rate, eta = self._rate_eta(state)
        log.info("step %d/%d epoch %d | loss %.4f over the last %d steps | %.0f tgt tok/s | ETA %s", state.step,
                 self.max_steps, state.epoch, self.sums["loss"] / tok, self.sums["steps"], rate, eta)

    def line(self, state: TrainState, last: StepStats) -> dict[str, float]:
        """Log the interval ending at ``state.step`` (``last``: that step's lr and grad norm); return its row."""
        s = self.sums
        tok, steps = max(s["tokens"], 1.0), max(s["steps"], 1.0)
        row = {"step": state.step, "epoch": state.epoch, "train_loss": s["loss"] / tok, "train_nll": s["nll"] / tok,
               "train_ppl": perplexity(s["nll"] / tok), "lr": last["lr"], "grad_norm": last["grad_norm"],
               "tgt_tokens_per_step": s["tokens"] / steps, "forwards_per_step": s["forwards"] / steps}
        rate, eta_text = self._rate_eta(state)
        extra = {"tgt_tokens_per_s": rate}
        if self.peak_flops:
            extra["mfu"] = rate * self.flops_per_token / self.peak_flops
        log.info("step %d/%d epoch %d | loss %.4f nll %.4f ppl %.2f | lr %.3g | gnorm %.3f | %.0f tgt tok/s%s | "
                 "%.0f tok/step in %.1f passes | ETA %s", state.step, self.max_steps, state.epoch, row["train_loss"],
                 row["train_nll"], row["train_ppl"], row["lr"], row["grad_norm"], rate,
                 f" | MFU {extra['mfu']:.1%}" if "mfu" in extra else "", row["tgt_tokens_per_step"],
                 row["forwards_per_step"], eta_text)
        self.tracker.log_metrics(chart_names({k: v for k, v in {**row, **extra}.items() if k not in ("step", "epoch")}),
                                 step=state.step)
        state.history.append(row)
        self.sums.update(dict.fromkeys(self.KEYS, 0.0))
        self.since_tokens = 0.0


#: MLflow's UI puts the charts of ``group/name`` metrics in one section per group: the curves first, then
#: throughput, then the batch's size (which hardly moves).
CHART_GROUPS = {"train_loss": "train/loss", "train_nll": "train/nll", "train_ppl": "train/ppl", "lr": "train/lr",
                "grad_norm": "train/grad_norm", "valid_loss": "valid/loss", "valid_nll": "valid/nll",
                "valid_ppl": "valid/ppl", "tgt_tokens_per_s": "speed/tgt_tokens_per_s", "mfu": "speed/mfu",
                "tgt_tokens_per_step": "batch/tgt_tokens_per_step", "forwards_per_step": "batch/forwards_per_step"}


def chart_names(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` under their MLflow chart names (:data:`CHART_GROUPS`)."""
    return {CHART_GROUPS.get(k, k): v for k, v in metrics.items()}


def log_valid(tracker: Any, state: TrainState, scores: dict[str, float]) -> None:
    """Log a validation at ``state.step`` (progress line, MLflow, ``state.history``)."""
    log.info("step %d valid | loss %.4f nll %.4f ppl %.2f", state.step, scores["valid_loss"],
             scores["valid_nll"], scores["valid_ppl"])
    tracker.log_metrics(chart_names(scores), step=state.step)
    state.history.append({"step": state.step, "epoch": state.epoch, **scores})


def history_csv(history: list[dict[str, float]]) -> str:
    """``train.csv``: one row per logged step (train interval and validation merged), fixed columns."""
    rows: dict[int, dict[str, float]] = {}
    for entry in history:
        rows.setdefault(entry["step"], {}).update(entry)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for step in sorted(rows):
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in rows[step].items()})
    return out.getvalue()
