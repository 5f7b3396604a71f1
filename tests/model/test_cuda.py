"""The model on CUDA (skipped without it): beam search against the CPU float64 search, and attention's backends.

Beam search on the GPU in float64 must give the CPU's float64 hypotheses token for token: the search
itself has no device-dependent step. The product decodes under bf16 autocast with fp32 logits
(:mod:`model.precision`); bf16 activations move scores by ~1e-2, enough to flip a near-tie of the
small trained reverser (tests/helpers/models.py): on an H200 a few of its 64 answers differed at beam 1
and at beam 4, and under CPU bf16 autocast 63 of 64 matched (benchmarks/RESULTS.md, GPU), so that path
must match on at least 60 of 64.
"""

from __future__ import annotations

import copy

import pytest
import torch

import model.layers
from model import Transformer, TransformerConfig, autocast, beam_search, best_hypothesis
from tests.helpers.models import trained_reverser

PAD, EOS = 0, 3


def _sources(n: int, seed: int) -> torch.Tensor:
    """[n, 9] int64: ids 4..12 of lengths 2..7, EOS, PAD after it."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((n, 9), PAD)
    for i in range(n):
        s = int(torch.randint(2, 8, (1,), generator=g))
        src[i, :s] = torch.randint(4, 13, (s,), generator=g)
        src[i, s] = EOS
    return src


def _finished(hyps) -> list[list[tuple[list[int], int]]]:
    return [[(h.tokens, h.step) for h in sent] for sent in hyps]


@pytest.mark.gpu
@pytest.mark.parametrize("beam", [1, 4])
def test_cuda_beam_search_equals_cpu_float64_token_for_token(beam: int) -> None:
    cpu = trained_reverser()
    src = _sources(64, seed=beam)
    want = beam_search(cpu, src, beam_size=beam, max_len_a=1.0, max_len_b=4, return_finished=True)
    dev = torch.device("cuda")
    # float64 on the GPU: the same finished hypotheses, in the same order, scores to rounding
    gpu64 = copy.deepcopy(cpu).to(dev)
    got64 = beam_search(gpu64, src.to(dev), beam_size=beam, max_len_a=1.0, max_len_b=4, return_finished=True)
    assert _finished(got64) == _finished(want)
    assert [h.score for s in got64 for h in s] == pytest.approx([h.score for s in want for h in s], abs=1e-9)
    # the product's path: fp32 weights under bf16 autocast, fp32 logits
    gpu32 = copy.deepcopy(cpu).float().to(dev)
    with torch.inference_mode(), autocast(dev):
        got32 = beam_search(gpu32, src.to(dev), beam_size=beam, max_len_a=1.0, max_len_b=4, return_finished=True)
        logits, _ = gpu32.decode_step(torch.full((2,), 2, device=dev),
                                      gpu32.init_state(gpu32.encode(src[:2].to(dev)), beam, 4))
    assert logits.dtype == torch.float32  # decoding scores are never bf16
    for alpha in (0.0, 0.6):
        same = sum(best_hypothesis(g, alpha) == best_hypothesis(w, alpha) for g, w in zip(got32, want))
        assert same >= 60, (alpha, same)


@pytest.mark.gpu
def test_attention_on_cuda_never_uses_cudnn_and_runs_the_causal_pass_without_flash(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN attention builds a graph per new shape (seconds per batch while decoding): it is switched off. The
    teacher-forced causal self-attention runs on the memory-efficient kernel (flash off); the rest may use flash."""
    seen: list[tuple[bool, bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                     bool(kwargs.get("is_causal"))))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(model.layers.F, "scaled_dot_product_attention", spy)
    dev = torch.device("cuda")
    m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_heads=2, d_ff=64, n_layers=1)).to(dev)
    src = _sources(8, seed=0).to(dev)
    with autocast(dev):
        m(src, src).float().sum().backward()
    with torch.inference_mode(), autocast(dev):
        beam_search(m.eval(), src, beam_size=2, max_len_a=1.0, max_len_b=2)
    assert seen and not any(cudnn for cudnn, _, _ in seen)
    assert {(flash, causal) for _, flash, causal in seen} == {(False, True), (True, False)}
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process-wide settings are left alone
    assert torch.backends.cuda.flash_sdp_enabled()
