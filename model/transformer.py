"""The encoder-decoder Transformer of "Attention Is All You Need" (base by default).
One embedding matrix for source, target and the output projection (§3.4); post-norm (paper) or pre-norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import TransformerConfig
from model.layers import DecoderLayer, EncoderLayer, key_mask, sinusoid_table
from model.precision import wide_dtype


class EncoderOut(NamedTuple):
    """Encoder output: memory [B, S, d], pad_mask [B, S] (True at padding), attn_mask [B, 1, 1, S] (True = attend)."""

    memory: Tensor
    pad_mask: Tensor
    attn_mask: Tensor


@dataclass
class DecoderState:
    """Incremental decoding state with room for ``beam`` adjacent rows per sentence, updated in place.

    Attributes:
        self_k: per layer [B·beam, capacity, H, dh] self-attention keys (``self_v``: values), rows in use first.
        spare_k: per layer a buffer like ``self_k`` (``spare_v``) that :meth:`Transformer.reorder_state` swaps in.
        cross_k: per layer [B, H, S, dh] cross-attention keys (``cross_v``: values), shared by a sentence's beams.
        mem_mask: [B, 1, 1, S] bool, True = the decoder may attend there.
        beam: the most rows per sentence.
        length: positions filled so far (the position of the next token).
    """

    self_k: list[Tensor]
    self_v: list[Tensor]
    spare_k: list[Tensor]
    spare_v: list[Tensor]
    cross_k: list[Tensor]
    cross_v: list[Tensor]
    mem_mask: Tensor
    beam: int
    length: int = 0


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
        x = self.embed(tokens) * math.sqrt(self.cfg.d_model)
        x = x + self.positions[offset : offset + tokens.shape[1]].to(x.dtype)
        return self.emb_dropout(x)

    def encode(self, src: Tensor) -> EncoderOut:
        """The encoder on src [B, S] int64 ids: memory [B, S, d] and the source masks."""
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

    def project(self, hidden: Tensor) -> Tensor:
        """Training's output projection: hidden [..., d] -> logits [..., V] in the ambient (autocast) precision."""
        return F.linear(hidden, self.embed.weight)

    def project_wide(self, hidden: Tensor) -> Tensor:
        """Output projection without autocast: hidden [..., d] -> logits [..., V] in fp32 (float64 if inputs are)."""
        weight = self.embed.weight
        dtype = wide_dtype(hidden, weight)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return F.linear(hidden.to(dtype), weight.to(dtype))

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Next-token logits [B, T, V] in the ambient precision for src [B, S] (BPE ids + EOS) and tgt_in [B, T]
        (BOS + target ids), both int64 and right-padded with ``pad_id``."""
        return self.project(self.decode(tgt_in, self.encode(src)))

    def init_state(self, enc: EncoderOut, beam: int = 1, capacity: int | None = None) -> DecoderState:
        """Decoding state for up to ``beam`` rows per sentence of ``enc`` (B sentences), ``capacity`` tokens long."""
        b, h, dh = enc.memory.shape[0], self.cfg.n_heads, self.cfg.head_dim
        capacity = self.cfg.max_positions if capacity is None else min(capacity, self.cfg.max_positions)
        cross = [layer.cross_attn.project_kv(enc.memory) for layer in self.decoder]
        like = cross[0][0]  # the decoder's dtype (bf16 under autocast)

        def buffers() -> list[Tensor]:
            return [like.new_empty(b * beam, capacity, h, dh) for _ in self.decoder]

        return DecoderState(buffers(), buffers(), buffers(), buffers(), [k for k, _ in cross],
                            [v for _, v in cross], enc.attn_mask, beam)

    def decode_step(self, tokens: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """Feed one token per row and get the next-token logits (layers in the ambient precision, projection fp32).

        Args:
            tokens: [N] or [N, 1] int64, the last token of every row (BOS first), N = B·r rows, r per sentence.
            state: from :meth:`init_state` or a previous step; its buffers are written in place.

        Returns:
            (logits [N, V] in fp32 or float64, ``state`` one token longer).
        """
        t, n, capacity = state.length, tokens.numel(), state.self_k[0].shape[1]
        if t >= capacity:
            raise ValueError(f"the decoder state holds {capacity} tokens; init_state(capacity=...) more")
        x = self._embed(tokens.view(n, 1), offset=t)
        for i, layer in enumerate(self.decoder):
            x = layer.step(x, state.self_k[i][:n], state.self_v[i][:n], t, state.cross_k[i], state.cross_v[i],
                           state.mem_mask)
        state.length = t + 1
        return self.project_wide(self.dec_norm(x))[:, 0], state

    @staticmethod
    def reorder_state(state: DecoderState, rows: Tensor, sentences: Tensor | None = None) -> DecoderState:
        """Keep and reorder rows in place: new row r continues old row ``rows[r]``.

        Args:
            rows: [N'] int64 old row per new row (rows of a sentence adjacent; a row may repeat).
            sentences: [B'] int64 the sentences kept, in their new order, or None when all stay.
        """
        t, n = state.length, rows.shape[0]
        for cur, spare in ((state.self_k, state.spare_k), (state.self_v, state.spare_v)):
            for i in range(len(cur)):
                torch.index_select(cur[i][:, :t], 0, rows, out=spare[i][:n, :t])
                cur[i], spare[i] = spare[i], cur[i]
        if sentences is not None:
            state.cross_k = [k.index_select(0, sentences) for k in state.cross_k]
            state.cross_v = [v.index_select(0, sentences) for v in state.cross_v]
            state.mem_mask = state.mem_mask.index_select(0, sentences)
        return state

    @torch.no_grad()
    def cross_attention(self, src: Tensor, tgt_in: Tensor, layer: int = -1) -> Tensor:
        """Cross-attention probabilities [H, T, S] of decoder ``layer`` for one pair src [S], tgt_in [T] (for plots)."""
        index = range(len(self.decoder))[layer]
        enc = self.encode(src.view(1, -1))
        x = self._embed(tgt_in.view(1, -1))
        for dec_layer in self.decoder[:index]:
            x = dec_layer(x, enc.memory, enc.attn_mask)
        return self.decoder[index].cross_weights(x, enc.memory, enc.attn_mask)[0]
