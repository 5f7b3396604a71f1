"""Building blocks: sinusoidal positions, attention with fused projections, encoder/decoder layers.
Boolean attention masks follow :func:`torch.nn.functional.scaled_dot_product_attention` (``True`` = may attend).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.config import TransformerConfig

#: SDPA backends on CUDA: all but cuDNN, which builds a graph per new shape and beam search changes shape every
#: step (12 searches: 10.7 s with cuDNN, 0.71 s without; H200, benchmarks/RESULTS.md).
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
#: SDPA backends for teacher-forced causal self-attention: at training lengths flash took 0.72/0.18 ms
#: (backward/forward), the memory-efficient kernel 0.21/0.11 ms (base model, H100, benchmarks/RESULTS.md).
CAUSAL_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sinusoid_table(n_positions: int, d_model: int) -> Tensor:
    """The paper's position encodings PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...): fp32 [P, d]."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)
    inv = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv[: d_model // 2])
    return table.float()


def key_mask(pad_mask: Tensor) -> Tensor:
    """Attention mask [B, 1, 1, S] (True = may attend) from a padding mask [B, S] (True at padding).

    A row with no real token attends to all positions: meaningless but finite, so no NaN reaches the gradients.
    """
    keep = ~pad_mask
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    return keep[:, None, None, :]


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a fused QKV projection (self) or a fused KV projection (cross)."""

    def __init__(self, cfg: TransformerConfig, *, cross: bool) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.cross = cross
        self.attn_dropout = cfg.attn_dropout
        d = cfg.d_model
        if cross:
            self.q_proj = nn.Linear(d, d)
            self.kv_proj = nn.Linear(d, 2 * d)
        else:
            self.qkv_proj = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)

    def _heads(self, x: Tensor) -> Tensor:  # [B, T, d] -> [B, H, T, dh]
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention keys and values of the encoder output: 2 x [B, H, S, dh]."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)
        return self._heads(k), self._heads(v)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention queries, keys, values: 3 x [B, H, T, dh]."""
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self._heads(q), self._heads(k), self._heads(v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
        """SDPA over heads, then the output projection: [B, H, T, dh] x3 -> [B, T, d]."""
        p = self.attn_dropout if self.training else 0.0
        backends = CAUSAL_ATTENTION if causal else CUDA_ATTENTION  # never cuDNN
        with sdpa_kernel(backends) if q.is_cuda else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def weights(self, q: Tensor, k: Tensor, mask: Tensor | None) -> Tensor:
        """Explicit attention probabilities [B, H, T, S] (for inspection, not training)."""
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype)


class FeedForward(nn.Module):
    """Position-wise FFN: Linear -> ReLU -> dropout -> Linear."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = nn.Dropout(cfg.ffn_dropout)

    def forward(self, x: Tensor) -> Tensor:
        """[..., d] -> [..., d]."""
        return self.fc2(self.dropout(F.relu(self.fc1(x))))


class _Residual(nn.Module):
    """One residual branch with its LayerNorm placed post (paper) or pre."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.pre_norm = cfg.pre_norm

    def inp(self, x: Tensor) -> Tensor:
        """What the sublayer sees."""
        return self.norm(x) if self.pre_norm else x

    def out(self, x: Tensor, y: Tensor) -> Tensor:
        """Combine the residual stream ``x`` with the sublayer output ``y``."""
        x = x + self.dropout(y)
        return x if self.pre_norm else self.norm(x)


class EncoderLayer(nn.Module):
    """Self-attention + FFN, each in a residual branch."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg, cross=False)
        self.ffn = FeedForward(cfg)
        self.res_attn = _Residual(cfg)
        self.res_ffn = _Residual(cfg)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x [B, S, d], mask [B, 1, 1, S] -> [B, S, d]."""
        q, k, v = self.self_attn.project_qkv(self.res_attn.inp(x))
        x = self.res_attn.out(x, self.self_attn.attend(q, k, v, mask))
        return self.res_ffn.out(x, self.ffn(self.res_ffn.inp(x)))


class DecoderLayer(nn.Module):
    """Causal self-attention + cross-attention + FFN, each in a residual branch."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg, cross=False)
        self.cross_attn = MultiHeadAttention(cfg, cross=True)
        self.ffn = FeedForward(cfg)
        self.res_self = _Residual(cfg)
        self.res_cross = _Residual(cfg)
        self.res_ffn = _Residual(cfg)

    def _after_self(self, x: Tensor, k_self: Tensor, v_self: Tensor, q: Tensor, causal: bool) -> Tensor:
        return self.res_self.out(x, self.self_attn.attend(q, k_self, v_self, None, causal=causal))

    def _tail(self, x: Tensor, k_mem: Tensor, v_mem: Tensor, mem_mask: Tensor) -> Tensor:
        q = self.cross_attn._heads(self.cross_attn.q_proj(self.res_cross.inp(x)))
        x = self.res_cross.out(x, self.cross_attn.attend(q, k_mem, v_mem, mem_mask))
        return self.res_ffn.out(x, self.ffn(self.res_ffn.inp(x)))

    def forward(self, x: Tensor, memory: Tensor, mem_mask: Tensor) -> Tensor:
        """Full (teacher-forced) pass: x [B, T, d], memory [B, S, d], mem_mask [B, 1, 1, S] -> [B, T, d]."""
        q, k, v = self.self_attn.project_qkv(self.res_self.inp(x))
        x = self._after_self(x, k, v, q, causal=True)
        k_mem, v_mem = self.cross_attn.project_kv(memory)
        return self._tail(x, k_mem, v_mem, mem_mask)

    def step(
        self, x: Tensor, k_buf: Tensor, v_buf: Tensor, t: int, k_mem: Tensor, v_mem: Tensor, mem_mask: Tensor
    ) -> Tensor:
        """One incremental step for N = B·beam rows, beam rows per sentence: x [N, 1, d] -> [N, 1, d].

        Args:
            x: [N, 1, d] the embedded token of every row at position t.
            k_buf: [N, capacity, H, dh] self-attention keys, positions < t filled; this step's is written at t.
            v_buf: [N, capacity, H, dh] self-attention values, the same way.
            k_mem: [B, H, S, dh] cross-attention keys, one per sentence.
            v_mem: [B, H, S, dh] cross-attention values.
            mem_mask: [B, 1, 1, S] bool source mask.
        """
        q, k, v = self.self_attn.project_qkv(self.res_self.inp(x))
        k_buf[:, t : t + 1] = k.transpose(1, 2)
        v_buf[:, t : t + 1] = v.transpose(1, 2)
        keys, values = k_buf[:, : t + 1].transpose(1, 2), v_buf[:, : t + 1].transpose(1, 2)  # [N, H, t + 1, dh]
        x = self._after_self(x, keys, values, q, causal=False)
        n, _, d = x.shape
        b = k_mem.shape[0]
        return self._tail(x.view(b, n // b, d), k_mem, v_mem, mem_mask).view(n, 1, d)

    def cross_weights(self, x: Tensor, memory: Tensor, mem_mask: Tensor) -> Tensor:
        """Explicit cross-attention probabilities [B, H, T, S] of this layer for decoder input ``x``."""
        q, k, v = self.self_attn.project_qkv(self.res_self.inp(x))
        x = self._after_self(x, k, v, q, causal=True)
        q = self.cross_attn._heads(self.cross_attn.q_proj(self.res_cross.inp(x)))
        k_mem, _ = self.cross_attn.project_kv(memory)
        return self.cross_attn.weights(q, k_mem, mem_mask)
