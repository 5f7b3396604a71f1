"""A toy decoder for beam-search tests: next-token probabilities looked up by the generated prefix."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn

PAD, A, BOS, EOS, B = 0, 1, 2, 3, 4  # toy vocabulary: V = 5


class FixedProbs(nn.Module):
    """Next-token probabilities looked up by the generated prefix (without BOS); a default otherwise."""

    def __init__(self, table: dict[tuple[int, ...], list[float]], default: list[float]) -> None:
        super().__init__()
        self.cfg = SimpleNamespace(pad_id=PAD, bos_id=BOS, eos_id=EOS)
        self.table, self.default = table, default

    def encode(self, src: Tensor) -> Tensor:
        return src

    def init_state(self, enc: Tensor, beam: int, capacity: int) -> Tensor:
        return enc.new_zeros(enc.shape[0], 0)  # one row per sentence until reorder_state

    def decode_step(self, tokens: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        cache = torch.cat([cache, tokens.view(-1, 1)], dim=1)
        rows = [self.table.get(tuple(r[1:]), self.default) for r in cache.tolist()]
        return torch.tensor(rows, dtype=torch.float64).log(), cache

    def reorder_state(self, cache: Tensor, rows: Tensor, sentences: Tensor | None) -> Tensor:
        return cache.index_select(0, rows)
