"""Label-smoothed negative log-likelihood (fairseq-style), as sums over non-pad tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.precision import wide


def _flat(logits: Tensor, target: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """Logits [N, V] and target [N], after checking ``epsilon`` and the shapes."""
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"label smoothing epsilon must be in [0, 1), got {epsilon}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match target {tuple(target.shape)} (+ vocab dim)")
    return logits.reshape(-1, logits.shape[-1]), target.reshape(-1)


def _sums(logits: Tensor, target: Tensor, epsilon: float, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(loss_sum, nll_sum) of logits [N, V] against target [N] in fp32 (or wider)."""
    lprobs = F.log_softmax(wide(logits), dim=-1)
    keep = target.ne(ignore_index)
    safe = target.masked_fill(~keep, 0).unsqueeze(-1)
    nll = -lprobs.gather(-1, safe).squeeze(-1)
    smooth = -lprobs.sum(dim=-1)
    zero = nll.new_zeros(())
    nll_sum = torch.where(keep, nll, zero).sum()
    smooth_sum = torch.where(keep, smooth, zero).sum()
    loss_sum = (1.0 - epsilon) * nll_sum + (epsilon / lprobs.shape[-1]) * smooth_sum
    return loss_sum, nll_sum


class _LeanSums(torch.autograd.Function):
    """(loss_sum, nll_sum) from three per-row reductions; the backward recomputes the softmax from the logits.
    nll = lse(x) - x[target] and mean_v(-log p[v]) = lse(x) - mean(x): the forward saves the logits and each row's
    fp32 log-sum-exp, never an [N, V] fp32 log-softmax.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, epsilon: float, ignore_index: int) -> tuple[Tensor, Tensor]:
        x = wide(logits)
        keep = target.ne(ignore_index)
        safe = target.masked_fill(~keep, 0)
        lse = torch.logsumexp(x, dim=-1)
        nll = lse - x.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        smooth = lse - x.mean(dim=-1)
        zero = nll.new_zeros(())
        nll_sum = torch.where(keep, nll, zero).sum()
        loss_sum = (1.0 - epsilon) * nll_sum + epsilon * torch.where(keep, smooth, zero).sum()
        ctx.save_for_backward(logits, lse, safe, keep)
        ctx.epsilon = epsilon
        return loss_sum, nll_sum

    @staticmethod
    def backward(ctx, g_loss: Tensor, g_nll: Tensor) -> tuple[Tensor | None, ...]:
        logits, lse, safe, keep = ctx.saved_tensors
        eps, v = ctx.epsilon, logits.shape[-1]
        x = wide(logits)
        hit = torch.arange(v, device=x.device) == safe.unsqueeze(-1)  # one-hot by comparison: pointwise, no scatter
        grad = (g_loss + g_nll) * torch.exp(x - lse.unsqueeze(-1)) - g_loss * (eps / v)
        grad = grad - torch.where(hit, (1.0 - eps) * g_loss + g_nll, torch.zeros((), dtype=x.dtype, device=x.device))
        grad = torch.where(keep.unsqueeze(-1), grad, torch.zeros((), dtype=x.dtype, device=x.device))
        return grad.to(logits.dtype), None, None, None


def label_smoothed_nll_loss_lean(
    logits: Tensor, target: Tensor, epsilon: float = 0.1, ignore_index: int = 0
) -> tuple[Tensor, Tensor]:
    """:func:`label_smoothed_nll_loss` that keeps no [N, V] fp32 tensor for the backward pass."""
    return _LeanSums.apply(*_flat(logits, target, epsilon), epsilon, ignore_index)


def label_smoothed_nll_loss(
    logits: Tensor, target: Tensor, epsilon: float = 0.1, ignore_index: int = 0
) -> tuple[Tensor, Tensor]:
    """Label-smoothed cross-entropy of logits [..., V] against int64 target ids [...], the log-softmax in fp32 or
    wider: per token (1 - ε) · (-log p[target]) + ε · mean_v(-log p[v]), where ε is ``epsilon`` in [0, 1).
    Returns (loss_sum, nll_sum), scalar sums over the tokens whose target is not ``ignore_index``.
    """
    return _sums(*_flat(logits, target, epsilon), epsilon, ignore_index)
