"""The one mutable object of a training run, :class:`TrainState`: everything else a step needs is fixed for the
run or derived from this position and the seed, so saving it in ``state.json`` makes a resume exact."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import cast

from pipeline.artifacts.checkpoint import StateFile
from pipeline.core.yamlfile import PlainMapping


@dataclass
class TrainState:
    """Where the run is: step, epoch, position in the epoch, tokens and time so far, memory skips, history."""

    step: int = 0
    epoch: int = 0
    position: int = 0  # next global batch of the epoch's order (steps already taken in this epoch)
    tokens_seen: int = 0  # non-pad target tokens trained on so far
    tokens_sq: float = 0.0  # sum of squared tokens per step (for the spread of the batch size)
    tokens_min: int = 0  # smallest and largest step, in non-pad target tokens
    tokens_max: int = 0
    src_tokens_seen: int | None = 0  # non-pad source tokens (None: resumed from a checkpoint that did not count them)
    forwards: int = 0  # forward passes so far on the busiest rank of each step (summed over steps)
    forwards_max: int = 0
    train_seconds: float = 0.0
    oom_skipped: int = 0  # optimizer steps skipped on every rank because one ran out of memory
    oom_streak: int = 0  # consecutive skipped steps (not saved)
    interval: dict[str, float] = field(default_factory=dict)
    """Sums of the log interval in progress: saved, so that the first line after a resume averages the same
    steps as an uninterrupted run."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Logged rows (train intervals and validations) up to ``step``: the plots file is rebuilt from it."""

    def advance(self, epoch_len: int) -> None:
        """Move past one global batch (into the next epoch after the epoch's ``epoch_len``-th)."""
        self.position += 1
        if self.position >= epoch_len:  # the epoch's last step (its generator is exhausted)
            self.epoch, self.position = self.epoch + 1, 0

    def count(self, tokens: int, forwards: int, src_tokens: int) -> None:
        """Add a taken step of ``tokens`` non-pad target (``src_tokens`` source) tokens and ``forwards`` passes."""
        first = self.step == 0
        self.step += 1
        self.tokens_seen += tokens
        self.src_tokens_seen = None if self.src_tokens_seen is None else self.src_tokens_seen + src_tokens
        self.tokens_sq += float(tokens) ** 2
        self.tokens_min = tokens if first else min(self.tokens_min, tokens)
        self.tokens_max = max(self.tokens_max, tokens)
        self.forwards += forwards
        self.forwards_max = max(self.forwards_max, forwards)

    def batch_stats(self) -> dict[str, float | None]:
        """Measured size of the optimizer steps so far: target tokens (mean, std, min, max), source tokens (mean),
        forward passes."""
        n = max(self.step, 1)
        mean = self.tokens_seen / n
        return {"tokens_per_step_mean": mean, "tokens_per_step_std": max(self.tokens_sq / n - mean * mean, 0.0) ** 0.5,
                "tokens_per_step_min": self.tokens_min, "tokens_per_step_max": self.tokens_max,
                "forwards_per_step_mean": self.forwards / n, "forwards_per_step_max": self.forwards_max,
                "src_tokens_per_step_mean": None if self.src_tokens_seen is None else self.src_tokens_seen / n}

    def to_json(self, *, world_size: int, config: PlainMapping, shards_sha256: str,
                mlflow_run_id: str | None) -> StateFile:
        """The ``state.json`` content for this position (all but ``oom_streak``)."""
        saved = cast(StateFile, {k: v for k, v in asdict(self).items() if k != "oom_streak"})  # StateFile's keys
        saved.update(train_seconds=round(self.train_seconds, 3), world_size=world_size, config=config,
                     shards_sha256=shards_sha256, mlflow_run_id=mlflow_run_id)
        return saved

    @classmethod
    def from_json(cls, state: StateFile) -> TrainState:
        """Inverse of :meth:`to_json` (the position part)."""
        written = dict(state)
        saved = {f.name: written[f.name] for f in fields(cls) if f.name in written and f.name != "oom_streak"}
        return cls(**({"src_tokens_seen": None} if state.get("step") else {}) | saved)  # None: not counted before
