"""How :mod:`model.beam` scores a finished hypothesis, and its two rules: which EOS candidates finish and when a
sentence is done.

Both take the same first 2k candidates per step and keep the same k best non-EOS ones live, with the same
GNMT length penalty lp(n) = ((5 + n) / 6)^α; they differ in what finishes and when they stop.

``fairseq`` (fairseq's ``sequence_generator.py``): an EOS candidate finishes only when it is among the first k;
a sentence is done once k hypotheses have finished; at max_len every live hypothesis finishes as it is. Pruning
uses raw scores, so the finished set, and one search, serve every α.

``t2t`` (tensor2tensor's ``utils/beam_search.py``, the code the paper names): every EOS candidate of the 2k
finishes; the finished set holds the k best by score / lp(n) (ties to the one finished first); a sentence stops
once its lowest finished score beats the best live raw score / lp(max_len), the best any live hypothesis could
still reach (``_is_finished``), or after max_len steps, where live hypotheses are dropped unless nothing has
finished: then the best live one is the answer. The stopping point depends on α: one search per α.

Where this ``t2t`` rule is not tensor2tensor's code: max_len is per sentence (t2t: one ``decode_length`` for the
batch), PAD and BOS never extend a hypothesis, raw scores are kept (t2t divides by lp(n) and multiplies back),
and a sentence that is done leaves the batch (in t2t it stays until all are done, and by the bound above no
later candidate of it can enter its finished set). A negative α voids that bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from model.config import BEAM_RULES


@dataclass(frozen=True)
class Hypothesis:
    """One finished hypothesis: ids without BOS and EOS, raw score, ``step`` n (with EOS) and ``order`` in its step."""

    tokens: list[int]
    score: float
    step: int
    order: int

    def final_score(self, alpha: float) -> float:
        """score / ((5 + step) / 6)^alpha, in float64."""
        return self.score / length_penalty(self.step, alpha)


def length_penalty(n: int, alpha: float) -> float:
    """GNMT length penalty ((5 + n) / 6)^alpha."""
    return ((5.0 + n) / 6.0) ** alpha


def best_hypothesis(finished: list[Hypothesis], alpha: float) -> list[int]:
    """The best final score's tokens; ties to the earliest (step, order). Empty list if none."""
    if not finished:
        return []
    best = min(finished, key=lambda h: (-h.final_score(alpha), h.step, h.order))
    return list(best.tokens)


class Step(NamedTuple):
    """One step's candidates as :mod:`model.beam` ranks them, before a rule's done and max_len decisions ([B, k];
    the eos fields [B, eos_width])."""

    eos_fin: Tensor
    eos_org: Tensor
    eos_score: Tensor
    live_ok: Tensor
    live_org: Tensor
    live_tok: Tensor
    live_score: Tensor
    live_pos: Tensor


def check_rule(rule: object) -> None:
    """Refuse anything but one of :data:`~model.config.BEAM_RULES` in one line."""
    if not isinstance(rule, str) or rule not in BEAM_RULES:
        raise ValueError(f"rule {rule!r:.40}: must be one of {', '.join(map(repr, BEAM_RULES))}")


def penalties(lengths: Sequence[int], alpha: float, device: torch.device) -> Tensor:
    """[len(lengths)] float64 :func:`length_penalty` of each length."""
    return torch.tensor([length_penalty(n, alpha) for n in lengths], dtype=torch.float64, device=device)


class FairseqStop:
    """fairseq's rule (module docstring): done with k finished; at max_len every live hypothesis finishes.

    Both rules' objects hold the state of the sentences still searching: ``eos_width`` (how many of a step's
    candidates, from the first, may finish with EOS), ``step`` (after step n: the live slots [B, k] that finish
    as they are, the sentences [B] that are done), ``keep`` (the sentences that go on) and ``select`` (a
    sentence's finished set, in finishing order, from every hypothesis that finished).
    """

    def __init__(self, k: int, n_sent: int, device: torch.device) -> None:
        self.k, self.eos_width = k, k
        self.n_done = torch.zeros(n_sent, dtype=torch.long, device=device)

    def step(self, st: Step, n: int, at_max: Tensor) -> tuple[Tensor, Tensor]:
        fin_live = st.live_ok & at_max[:, None]
        self.n_done = self.n_done + st.eos_fin.sum(1) + fin_live.sum(1)
        return fin_live, at_max | self.n_done.ge(self.k)

    def keep(self, rows: Tensor) -> None:
        self.n_done = self.n_done[rows]

    def select(self, finished: list[Hypothesis]) -> list[Hypothesis]:
        return finished


class T2TStop:
    """tensor2tensor's rule (module docstring).

    Args:
        k: the beam size.
        alpha: the length-penalty exponent the finished set and the bound use.
        max_lp: [B] lp(max_len) of each sentence (:func:`penalties`), cast to the scores' dtype at the first step.
    """

    def __init__(self, k: int, alpha: float, max_lp: Tensor) -> None:
        self.k, self.alpha, self.eos_width, self.max_lp = k, alpha, 2 * k, max_lp
        self.fin: Tensor | None = None  # [B, k] the finished set's scores / lp(n), descending, -inf where empty

    def step(self, st: Step, n: int, at_max: Tensor) -> tuple[Tensor, Tensor]:
        new = (st.eos_score / length_penalty(n, self.alpha)).masked_fill(~st.eos_fin, float("-inf"))
        if self.fin is None:
            self.fin, self.max_lp = new[:, :0], self.max_lp.to(new.dtype)
        self.fin = torch.cat([self.fin, new], dim=1).topk(self.k, dim=1).values
        any_fin = self.fin[:, 0] > float("-inf")
        lowest = self.fin.masked_fill(self.fin == float("-inf"), float("inf")).min(1).values
        best_live = st.live_score[:, 0]  # -inf without a live hypothesis
        done = at_max | (any_fin & (lowest > best_live / self.max_lp)) | ~st.live_ok[:, 0]
        fin_live = torch.zeros_like(st.live_ok)
        fin_live[:, 0] = at_max & ~any_fin & st.live_ok[:, 0]
        return fin_live, done

    def keep(self, rows: Tensor) -> None:
        assert self.fin is not None, "keep comes after a step"
        self.fin, self.max_lp = self.fin[rows], self.max_lp[rows]

    def select(self, finished: list[Hypothesis]) -> list[Hypothesis]:
        best = sorted(finished, key=lambda h: (-h.final_score(self.alpha), h.step, h.order))[: self.k]
        return sorted(best, key=lambda h: (h.step, h.order))
