"""The precision the network runs at on a device: bf16 autocast on CUDA, fp32 elsewhere.

Training, validation, the memory pre-flight and decoding all enter :func:`autocast`, so they agree.
"""

from __future__ import annotations

import contextlib

import torch


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (weights and the loss stay fp32), nothing on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
