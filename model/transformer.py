"""The encoder-decoder Transformer ("Attention Is All You Need", base by default).

Shared embedding matrix for source, target and the output projection; embeddings scaled by
sqrt(d_model) plus sinusoidal positions; post-norm (paper) or pre-norm. Sequences are right-padded
with ``pad_id``; every mask is derived from the token ids inside.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import TransformerConfig
from model.layers import DecoderLayer, EncoderLayer, key_mask, sinusoid_table
from model.precision import wide_dtype


class EncoderOut(NamedTuple):
    """What the encoder hands to the decoder (every field has the batch on dim 0).

    Attributes:
        memory: [B, S, d] encoder output.
        pad_mask: [B, S] bool, True at source padding.
        attn_mask: [B, 1, 1, S] bool, True = the decoder may attend there (NaN-safe for empty rows).
    """

    memory: Tensor
    pad_mask: Tensor
    attn_mask: Tensor


class DecoderCache(NamedTuple):
    """Incremental decoding state, one entry per decoder layer (batch on dim 0 of every tensor).

    Attributes:
        self_k: per layer [B, H, t, dh] self-attention keys of the t tokens fed so far.
        self_v: per layer [B, H, t, dh] self-attention values.
        cross_k: per layer [B, H, S, dh] cross-attention keys (computed once in ``init_cache``).
        cross_v: per layer [B, H, S, dh] cross-attention values.
    """

    self_k: list[Tensor]
    self_v: list[Tensor]
    cross_k: list[Tensor]
    cross_v: list[Tensor]

    @property
    def length(self) -> int:
        """Number of decoder tokens fed so far (the position of the next one)."""
        return self.self_k[0].shape[2]


class Transformer(nn.Module):
    """Encoder-decoder Transformer with tied embeddings. Knows nothing about files, ranks or tracking."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("TransformerConfig.vocab_size is 0 (not known yet): set it from the BPE model with "
                             "cfg.with_vocab(n) before building the model")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.register_buffer("positions", sinusoid_table(cfg.max_positions, cfg.d_model), persistent=False)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.enc_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.dec_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform linear weights, zero biases, embeddings N(0, d^-0.5) with a zero pad row."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        nn.init.normal_(self.embed.weight, mean=0.0, std=self.cfg.d_model**-0.5)
        with torch.no_grad():
            self.embed.weight[self.cfg.pad_id].zero_()

    def _embed(self, tokens: Tensor, offset: int = 0) -> Tensor:
        """[B, T] ids -> [B, T, d]: scaled embedding + positions offset..offset+T-1, then dropout."""
        t = tokens.shape[1]
        x = self.embed(tokens) * math.sqrt(self.cfg.d_model)
        x = x + self.positions[offset : offset + t].to(x.dtype)
        return self.emb_dropout(x)

    def encode(self, src: Tensor) -> EncoderOut:
        """Run the encoder.

        Args:
            src: [B, S] int64 source ids, right-padded with ``pad_id``.

        Returns:
            :class:`EncoderOut` with memory [B, S, d] and the source masks.
        """
        pad_mask = src.eq(self.cfg.pad_id)
        mask = key_mask(pad_mask)
        x = self._embed(src)
        for layer in self.encoder:
            x = layer(x, mask)
        return EncoderOut(self.enc_norm(x), pad_mask, mask)

    def decode(self, tgt_in: Tensor, enc: EncoderOut) -> Tensor:
        """Teacher-forced decoder: tgt_in [B, T] -> hidden [B, T, d] (before the output projection)."""
        x = self._embed(tgt_in)
        for layer in self.decoder:
            x = layer(x, enc.memory, enc.attn_mask)
        return self.dec_norm(x)

    def features(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Decoder output before the projection: src [B, S], tgt_in [B, T] -> [B, T, d]."""
        return self.decode(tgt_in, self.encode(src))

    def project(self, hidden: Tensor) -> Tensor:
        """Output projection with the shared embedding matrix, in the ambient (autocast) precision.

        Training's path: under bf16 autocast the logits are bf16 and the loss widens them itself.

        Args:
            hidden: [..., d] decoder output.

        Returns:
            [..., V] logits.
        """
        return F.linear(hidden, self.embed.weight)

    def project_wide(self, hidden: Tensor) -> Tensor:
        """Output projection in fp32 (or wider) with autocast disabled: decoding's scores.

        The hidden state may be bf16 (the decoder runs under the caller's autocast); it and the
        embedding matrix are cast up to fp32 (float64 stays float64) before the matmul, so the logits
        are not rounded to bf16's 8 significant bits.

        Args:
            hidden: [..., d] decoder output, any floating dtype.

        Returns:
            [..., V] logits in fp32, or float64 when ``hidden`` or the weights are float64.
        """
        weight = self.embed.weight
        dtype = wide_dtype(hidden, weight)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return F.linear(hidden.to(dtype), weight.to(dtype))

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Logits of the next token at every target position.

        Args:
            src: [B, S] int64 source ids (BPE ids + EOS), right-padded with ``pad_id``.
            tgt_in: [B, T] int64 decoder input (BOS + target ids), right-padded with ``pad_id``.

        Returns:
            [B, T, V] logits in the ambient precision (bf16 under autocast; the loss widens them).
        """
        return self.project(self.features(src, tgt_in))

    # ---- incremental decoding -------------------------------------------------------------

    def init_cache(self, enc: EncoderOut) -> DecoderCache:
        """Empty self-attention caches and the cross-attention K/V of ``enc`` (computed once)."""
        b = enc.memory.shape[0]
        h, dh = self.cfg.n_heads, self.cfg.head_dim
        empty = enc.memory.new_zeros(b, h, 0, dh)
        cross = [layer.cross_attn.project_kv(enc.memory) for layer in self.decoder]
        n = len(self.decoder)
        return DecoderCache([empty] * n, [empty] * n, [k for k, _ in cross], [v for _, v in cross])

    def decode_step(self, tokens: Tensor, enc: EncoderOut, cache: DecoderCache) -> tuple[Tensor, DecoderCache]:
        """Feed one token per row and get the next-token logits, computed in fp32.

        The decoder layers run in the ambient precision (bf16 under the caller's autocast, like the
        cache); the output projection runs in fp32 with autocast disabled (:meth:`project_wide`), so
        the logits that beam search ranks are fp32 even when decoding under bf16 autocast.

        Args:
            tokens: [B] or [B, 1] int64, the last token of every row (BOS first).
            enc: encoder output with the same rows as the cache.
            cache: from :meth:`init_cache` or a previous ``decode_step``.

        Returns:
            (logits [B, V] in fp32, or float64 for a float64 model; the extended cache).
        """
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(1)
        x = self._embed(tokens, offset=cache.length)
        new_k, new_v = [], []
        for i, layer in enumerate(self.decoder):
            x, k, v = layer.step(x, cache.self_k[i], cache.self_v[i], cache.cross_k[i], cache.cross_v[i], enc.attn_mask)
            new_k.append(k)
            new_v.append(v)
        logits = self.project_wide(self.dec_norm(x))[:, 0]
        return logits, DecoderCache(new_k, new_v, cache.cross_k, cache.cross_v)

    @staticmethod
    def reorder_cache(cache: DecoderCache, index: Tensor) -> DecoderCache:
        """Select rows of every cached tensor: index [B'] int64 -> cache with B' rows."""

        def sel(ts: list[Tensor]) -> list[Tensor]:
            return [t.index_select(0, index) for t in ts]

        return DecoderCache(sel(cache.self_k), sel(cache.self_v), sel(cache.cross_k), sel(cache.cross_v))

    @staticmethod
    def reorder_encoder_out(enc: EncoderOut, index: Tensor) -> EncoderOut:
        """Select rows of the encoder output: index [B'] int64 -> EncoderOut with B' rows."""
        return EncoderOut(*(t.index_select(0, index) for t in enc))

    # ---- inspection ---------------------------------------------------------------------

    @torch.no_grad()
    def cross_attention(self, src: Tensor, tgt_in: Tensor, layer: int = -1) -> Tensor:
        """Cross-attention probabilities of one sentence pair, computed explicitly (for plots).

        Args:
            src: [S] or [1, S] source ids.
            tgt_in: [T] or [1, T] decoder input ids (BOS + target).
            layer: decoder layer index (negative counts from the end).

        Returns:
            [H, T, S] float attention probabilities (rows sum to 1 over real source tokens).
        """
        src = src.view(1, -1)
        tgt_in = tgt_in.view(1, -1)
        index = range(len(self.decoder))[layer]
        enc = self.encode(src)
        x = self._embed(tgt_in)
        for i, dec_layer in enumerate(self.decoder):
            if i == index:
                return dec_layer.cross_weights(x, enc.memory, enc.attn_mask)[0]
            x = dec_layer(x, enc.memory, enc.attn_mask)
        raise AssertionError("unreachable")
