"""Decoding scores in fp32 under bf16 autocast: the output projection and the log-softmax escape autocast."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import model.beam as beam_module
from model import Transformer, TransformerConfig, beam_search

PAD, BOS, EOS = 0, 2, 3


def tiny_fp32(pre_norm: bool) -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=29, d_model=32, n_heads=4, d_ff=64, n_layers=2, pre_norm=pre_norm,
                            max_positions=64)
    return Transformer(cfg).eval()


def not_bf16_rounded(t: Tensor) -> bool:
    """True when some entry of ``t`` is not exactly representable in bf16 (it was not computed in bf16)."""
    return bool((t.to(torch.bfloat16).to(t.dtype) != t).any())


SRC = torch.tensor([[5, 6, 7, 8, EOS], [9, 10, EOS, PAD, PAD]])


@pytest.mark.parametrize("pre_norm", [False, True])
def test_beam_search_under_bf16_autocast_scores_fp32_logits(pre_norm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny_fp32(pre_norm)
    seen: list[Tensor] = []
    real_log_softmax = torch.log_softmax

    def recording_log_softmax(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        seen.append(x.detach().clone())
        return real_log_softmax(x, *args, **kwargs)

    monkeypatch.setattr(beam_module.torch, "log_softmax", recording_log_softmax)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = beam_search(m, SRC, beam_size=3, max_len_a=1.0, max_len_b=3)
    assert len(out) == 2 and seen, "the search should have scored at least one step"
    assert all(x.dtype == torch.float32 for x in seen), {x.dtype for x in seen}
    # bf16 logits cast up to fp32 would all be bf16-representable: these were computed in fp32
    assert all(not_bf16_rounded(x) for x in seen)


@pytest.mark.parametrize("pre_norm", [False, True])
def test_decode_step_projects_the_decoder_state_in_fp32_under_autocast(pre_norm: bool) -> None:
    m = tiny_fp32(pre_norm)
    states: list[Tensor] = []
    m.dec_norm.register_forward_hook(lambda _mod, _inp, out: states.append(out))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        enc = m.encode(SRC)
        state = m.init_state(enc, beam=1, capacity=2)
        assert state.cross_k[0].dtype == state.self_k[0].dtype == torch.bfloat16, "the decoder should run in bf16"
        logits, state = m.decode_step(torch.full((2,), BOS), state)
        logits, _ = m.decode_step(torch.tensor([11, 12]), state)
    assert logits.dtype == torch.float32 and logits.shape == (2, 29)
    want = F.linear(states[-1].float(), m.embed.weight.float())[:, 0]  # fp32, outside autocast
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)
    assert not_bf16_rounded(logits)


def test_training_forward_keeps_the_ambient_precision() -> None:
    m = tiny_fp32(pre_norm=False)
    tgt = torch.tensor([[BOS, 4, 5], [BOS, 6, PAD]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(SRC, tgt).dtype == torch.bfloat16  # the loss widens it (label_smoothed_nll_loss)
    assert m(SRC, tgt).dtype == torch.float32
