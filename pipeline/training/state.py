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
    """Where the run is: step, epoch, next micro-batch, tokens and time so far, memory skips, history."""

    step: int = 0
    epoch: int = 0
    micro: int = 0
    """Next global micro-batch index in the epoch."""
    tokens_seen: int = 0
    """Non-pad target tokens trained on so far."""
    train_seconds: float = 0.0
    oom_skipped: int = 0
    """Optimizer steps skipped on every rank because one ran out of memory."""
    oom_streak: int = 0
    """Consecutive skipped steps (not saved)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """Logged rows (train intervals and validations) up to ``step``: the plots file is rebuilt from it."""

    def advance(self, micro_batches: int, epoch_len: int) -> None:
        """Move past one step's ``micro_batches`` global micro-batches (into the next epoch at its end)."""
        self.micro += micro_batches
        if self.micro >= epoch_len:  # the epoch's last step (its generator is exhausted)
            self.epoch, self.micro = self.epoch + 1, 0

    def to_json(self, *, world_size: int, config: dict[str, Any], shards_sha256: str,
                mlflow_run_id: str | None) -> dict[str, Any]:
        """The ``state.json`` content for this position."""
        return {"step": self.step, "epoch": self.epoch, "micro_batch": self.micro, "world_size": world_size,
                "tokens_seen": self.tokens_seen, "train_seconds": round(self.train_seconds, 3), "config": config,
                "oom_skipped": self.oom_skipped,
                "shards_sha256": shards_sha256, "mlflow_run_id": mlflow_run_id, "history": self.history}

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> TrainState:
        """Inverse of :meth:`to_json` (the position part)."""
        return cls(step=state["step"], epoch=state["epoch"], micro=state["micro_batch"],
                   tokens_seen=state["tokens_seen"], train_seconds=state["train_seconds"],
                   oom_skipped=state.get("oom_skipped", 0), history=state["history"])
