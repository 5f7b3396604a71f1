"""The precision the network runs at: bf16 autocast on CUDA, fp32 elsewhere, the same for every caller.
Scores are the exception: log-softmax runs in fp32 or wider (bf16 would round nearby logits to ties).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (weights and the loss stay fp32), nothing on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def wide_dtype(*tensors: Tensor) -> torch.dtype:
    """fp32, or the widest floating dtype among ``tensors`` when that is wider (float64)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def wide(x: Tensor) -> Tensor:
    """Cast to fp32, or keep a wider dtype (float64)."""
    return x.to(wide_dtype(x))
