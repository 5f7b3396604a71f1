"""The one mutable object of a training run: :class:`TrainState`, its position and counters.

Everything else a step needs is either fixed for the run (model, optimizer, batch plan) or derived
from this position and the seed (batch order, dropout masks), so saving it in ``state.json`` makes
a resume exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    """Where the run is: step, epoch, position in the epoch, tokens and time so far, memory skips, history."""

    step: int = 0
    epoch: int = 0
    position: int = 0
    """Next global batch of the epoch's order (steps already taken in this epoch)."""
    tokens_seen: int = 0
    """Non-pad target tokens trained on so far."""
    tokens_sq: float = 0.0
    """Sum of squared tokens per step (for the spread of the batch size)."""
    tokens_min: int = 0
    tokens_max: int = 0
    """Smallest and largest step, in non-pad target tokens."""
    forwards: int = 0
    """Forward passes so far on the busiest rank of each step (summed over steps)."""
    forwards_max: int = 0
    train_seconds: float = 0.0
    oom_skipped: int = 0
    """Optimizer steps skipped on every rank because one ran out of memory."""
    oom_streak: int = 0
    """Consecutive skipped steps (not saved)."""
    interval: dict[str, float] = field(default_factory=dict)
    """Sums of the log interval in progress (loss, nll, tokens, forwards, steps): saved, so that the
    first line after a resume averages the same steps as an uninterrupted run."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Logged rows (train intervals and validations) up to ``step``: the plots file is rebuilt from it."""

    def advance(self, epoch_len: int) -> None:
        """Move past one global batch (into the next epoch after the epoch's ``epoch_len``-th)."""
        self.position += 1
        if self.position >= epoch_len:  # the epoch's last step (its generator is exhausted)
            self.epoch, self.position = self.epoch + 1, 0

    def count(self, tokens: int, forwards: int) -> None:
        """Add a taken step of ``tokens`` non-pad target tokens and ``forwards`` passes (busiest rank)."""
        first = self.step == 0
        self.step += 1
        self.tokens_seen += tokens
        self.tokens_sq += float(tokens) ** 2
        self.tokens_min = tokens if first else min(self.tokens_min, tokens)
        self.tokens_max = max(self.tokens_max, tokens)
        self.forwards += forwards
        self.forwards_max = max(self.forwards_max, forwards)

    def batch_stats(self) -> dict[str, float]:
        """Measured size of the optimizer steps so far: target tokens (mean, std, min, max), forward passes."""
        n = max(self.step, 1)
        mean = self.tokens_seen / n
        return {"tokens_per_step_mean": mean, "tokens_per_step_std": max(self.tokens_sq / n - mean * mean, 0.0) ** 0.5,
                "tokens_per_step_min": self.tokens_min, "tokens_per_step_max": self.tokens_max,
                "forwards_per_step_mean": self.forwards / n, "forwards_per_step_max": self.forwards_max}

    def to_json(self, *, world_size: int, config: dict[str, Any], shards_sha256: str,
                mlflow_run_id: str | None) -> dict[str, Any]:
        """The ``state.json`` content for this position."""
        return {"step": self.step, "epoch": self.epoch, "position": self.position, "world_size": world_size,
                "tokens_seen": self.tokens_seen, "tokens_sq": self.tokens_sq, "tokens_min": self.tokens_min,
                "tokens_max": self.tokens_max, "forwards": self.forwards, "forwards_max": self.forwards_max,
                "train_seconds": round(self.train_seconds, 3), "config": config, "oom_skipped": self.oom_skipped,
                "shards_sha256": shards_sha256, "mlflow_run_id": mlflow_run_id, "interval": dict(self.interval),
                "history": self.history}

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> TrainState:
        """Inverse of :meth:`to_json` (the position part)."""
        return cls(step=state["step"], epoch=state["epoch"], position=state["position"],
                   tokens_seen=state["tokens_seen"], tokens_sq=state["tokens_sq"], tokens_min=state["tokens_min"],
                   tokens_max=state["tokens_max"], forwards=state["forwards"], forwards_max=state["forwards_max"],
                   train_seconds=state["train_seconds"], interval=dict(state.get("interval") or {}),
                   oom_skipped=state.get("oom_skipped", 0), history=state["history"])
