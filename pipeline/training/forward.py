"""One forward pass and its loss sums, eager or compiled: what training steps, validation and the pre-flight call.

With ``NMT_COMPILE`` on, :func:`loss_function` compiles :func:`lean_batch_loss`; with dropout inductor draws its
own masks, so a run resumed under the other setting is not bitwise equal. :class:`PassLoss` is the same loss as a
module, what ``DistributedDataParallel`` wraps on several ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from model import Transformer, label_smoothed_nll_loss, label_smoothed_nll_loss_lean

log = logging.getLogger(__name__)

BatchLoss = Callable[[Transformer, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]


def batch_loss(model: Transformer, src: Tensor, tgt_in: Tensor, tgt_out: Tensor,
               epsilon: float) -> tuple[Tensor, Tensor]:
    """The label-smoothed loss of one padded batch (call it under the device's autocast).

    Args:
        src: [B, S] int64 source ids, right-padded with the pad id.
        tgt_in: [B, T] int64 decoder input (BOS + target ids), right-padded.
        tgt_out: [B, T] int64 targets (target ids + EOS), right-padded.

    Returns:
        (loss_sum, nll_sum): fp32 scalars summed over the non-pad targets.
    """
    logits = model(src, tgt_in)
    return label_smoothed_nll_loss(logits, tgt_out, epsilon=epsilon, ignore_index=model.cfg.pad_id)


def lean_batch_loss(model: Transformer, src: Tensor, tgt_in: Tensor, tgt_out: Tensor,
                    epsilon: float) -> tuple[Tensor, Tensor]:
    """:func:`batch_loss` through the lean loss (the same sums up to float rounding): what ``NMT_COMPILE`` runs."""
    logits = model(src, tgt_in)
    return label_smoothed_nll_loss_lean(logits, tgt_out, epsilon=epsilon, ignore_index=model.cfg.pad_id)


class PassLoss(torch.nn.Module):
    """``loss(model, src, tgt_in, tgt_out, epsilon)`` as a module of ``model``: one forward pass's loss sums."""

    def __init__(self, model: Transformer, loss: BatchLoss) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
        return self.loss(self.model, src, tgt_in, tgt_out, epsilon)


def loss_function(compiled: bool) -> BatchLoss:
    """:func:`batch_loss`, or :func:`lean_batch_loss` under ``torch.compile`` when ``compiled``."""
    if not compiled:
        return batch_loss
    log.info("torch.compile (NMT_COMPILE): on; the first forward pass compiles")
    return torch.compile(lean_batch_loss, dynamic=True)
