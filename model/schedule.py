"""The paper's learning-rate schedule (linear warmup, then inverse square root decay)."""

from __future__ import annotations


def inverse_sqrt_lr(step: int, d_model: int = 512, warmup: int = 4000, scale: float = 1.0) -> float:
    """lr = scale · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5) at ``step`` (from 1); the paper's §5.3."""
    if step < 1:
        raise ValueError(f"learning-rate step counts from 1, got {step}")
    if warmup < 1 or d_model < 1:
        raise ValueError(f"warmup ({warmup}) and d_model ({d_model}) must be >= 1")
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
