"""A training run's logged rows, shaped as the training loop logs them (for ``train.csv`` and its curves)."""

from __future__ import annotations

import math


def training_history(steps: int, valid_every: int, log_every: int) -> list[dict]:
    """A train interval every ``log_every`` steps and a validation every ``valid_every``, with falling loss."""
    rows: list[dict] = []
    for step in range(log_every, steps + 1, log_every):
        loss = 8.0 / (1 + step / 50)
        rows.append({"step": step, "epoch": step // 100, "train_loss": loss, "train_nll": loss - 0.3,
                     "train_ppl": math.exp(loss - 0.3), "lr": 1e-3 * min(step / 40, (40 / step) ** 0.5),
                     "grad_norm": 0.7, "tgt_tokens_per_step": 1024.0, "forwards_per_step": 1})
        if step % valid_every == 0:
            rows.append({"step": step, "epoch": step // 100, "valid_loss": loss + 0.1, "valid_nll": loss - 0.2,
                         "valid_ppl": math.exp(loss - 0.2)})
    return rows
