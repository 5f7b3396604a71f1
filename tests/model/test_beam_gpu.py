"""Beam search on CUDA against the CPU float64 search, token for token (skipped without CUDA).

The product decodes on a GPU under bf16 autocast with fp32 logits (:mod:`model.precision`); the
reference is the same trained model on the CPU in float64. A confidently trained model (the reverser
of tests/helpers/models.py) leaves no near-ties for bf16 rounding to flip, so the answers must match.
"""

from __future__ import annotations

import copy

import pytest
import torch

from model import autocast, beam_search, best_hypothesis
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
        assert [best_hypothesis(h, alpha) for h in got32] == [best_hypothesis(h, alpha) for h in want]
