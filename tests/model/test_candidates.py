"""The first 2k candidates of a step (model/candidates.py): every path equals a literal sort, ties included."""

from __future__ import annotations

import pytest
import torch

from model.candidates import (chunk_count, top_candidates, top_from_chunk_maxima, top_with_tie_pass,
                              top_without_boundary_ties)

@pytest.mark.parametrize("seed", range(6))
def test_top_candidates_equals_a_literal_sort_with_ties_and_invalid_slots(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, slots, vocab, n2 = 6, 3, 7, 6
    n = slots * vocab
    flat = torch.randint(-3, 1, (b, n), generator=g).float()  # few distinct values: many exact ties
    flat[torch.rand(b, n, generator=g) < [0.1, 0.3, 0.6, 0.9, 0.95, 1.0][seed]] = float("-inf")  # valid may be -inf
    live = torch.randint(0, slots + 1, (b,), generator=g)  # live slots are a prefix
    valid = ((torch.arange(slots) < live[:, None])[:, :, None] & (torch.arange(vocab) % 4 != 0)).view(b, n)
    flat = flat.masked_fill(~valid, float("-inf"))
    tie_rank = torch.where(torch.arange(n) % vocab % 4 != 0, torch.arange(n, 0, -1), 0)  # banned tokens: 0
    index, score, ok = top_candidates(flat, tie_rank.int(), valid.sum(1), n2)
    for r in range(b):
        want = sorted((i for i in range(n) if valid[r, i]), key=lambda i: (-flat[r, i].item(), i))[:n2]
        assert index[r, : len(want)].tolist() == want
        assert ok[r].tolist() == [True] * len(want) + [False] * (n2 - len(want))
        assert score[r, : len(want)].tolist() == flat[r, want].tolist()
        assert (score[r, len(want):] == float("-inf")).all()


@pytest.mark.parametrize("seed", range(4))
def test_one_topk_when_no_row_ties_at_its_threshold(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, n, n2 = 5, 40, 8
    flat = torch.randperm(b * n, generator=g).view(b, n).float()  # distinct scores ...
    flat[:, :6] = flat.max(1, keepdim=True).values + 1  # ... but for a tie above every threshold
    flat[:, -3:] = float("-inf")
    found = top_without_boundary_ties(flat, n2)
    assert found is not None
    index, score, ok = found
    for r in range(b):
        want = sorted(range(n), key=lambda i: (-flat[r, i].item(), i))[:n2]
        assert index[r].tolist() == want and score[r].tolist() == flat[r, want].tolist() and ok[r].all()
    tie_rank = torch.arange(n, 0, -1, dtype=torch.int32)
    general = top_with_tie_pass(flat, tie_rank, torch.full((b,), n - 3), n2)
    assert all(torch.equal(x, y) for x, y in zip(found, general))


def test_a_tie_at_a_threshold_takes_the_general_path() -> None:
    flat = torch.tensor([[5.0, 4.0, 3.0, 3.0, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    assert top_without_boundary_ties(flat, 3) is None  # row 0: the 3rd and the 4th are equal
    assert top_without_boundary_ties(flat[1:], 3) is not None
    assert top_without_boundary_ties(flat[1:], 5) is None  # nothing beyond n2 to compare with
    index, _, ok = top_candidates(flat, torch.arange(5, 0, -1, dtype=torch.int32), torch.full((2,), 5), 3)
    assert index.tolist() == [[0, 1, 2], [0, 1, 2]] and ok.all()


def test_chunk_count_divides_the_vocabulary_into_chunks_of_two_or_more() -> None:
    assert [chunk_count(v) for v in (8000, 32000, 37000, 96, 64, 31, 13, 5)] == [64, 64, 50, 48, 32, None, None, None]


def literal_top(flat: torch.Tensor, n2: int) -> list[list[int]]:
    return [sorted(range(flat.shape[1]), key=lambda i: (-row[i], i))[:n2] for row in flat.tolist()]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("values", ["distinct", "tied"])
def test_chunk_maxima_find_what_one_topk_finds_or_decline(seed: int, values: str) -> None:
    g = torch.Generator().manual_seed(seed)
    b, slots, vocab, n2 = 7, 4, 96, 8
    if values == "distinct":
        lprobs = torch.randn(b, slots, vocab, generator=g).mul(3).log_softmax(-1)
    else:  # few distinct values: exact ties inside and across chunks and slots
        lprobs = torch.randint(-4, 0, (b, slots, vocab), generator=g).float()
    lprobs[:, :, [0, 2]] = float("-inf")  # banned tokens
    scores = torch.randn(b, slots, generator=g).mul(2)
    scores[1, 1:] = float("-inf")  # one live slot: 3 empty ones
    scores[2, 2:] = float("-inf")
    flat = (lprobs + scores[:, :, None]).view(b, -1)
    found = top_from_chunk_maxima(lprobs, scores, n2)
    plain = top_without_boundary_ties(flat, n2)
    if values == "distinct":
        assert found is not None, "continuous scores: the chunk path must answer, or this test checks nothing"
    if found is None:
        return
    assert plain is not None, "the chunk path answered where a tie at a threshold makes the answer ambiguous"
    assert all(torch.equal(x, y) for x, y in zip(found, plain))
    assert found[0].tolist() == literal_top(flat, n2)
    assert torch.equal(found[1], flat.gather(1, found[0]))  # the same float sums as the full [B, slots·V] add


def test_chunk_maxima_decline_a_tie_at_the_threshold_and_too_few_chunks() -> None:
    lprobs = torch.full((1, 1, 64), -10.0)
    lprobs[0, 0, :5] = torch.tensor([-1.0, -2.0, -3.0, -3.0, -4.0])
    scores = torch.zeros(1, 1)
    assert top_from_chunk_maxima(lprobs.repeat(1, 4, 1), scores.repeat(1, 4), 3) is None  # ties across slots
    assert top_from_chunk_maxima(lprobs[:, :, :8], scores, 3) is None  # 4 chunks of 2: not more than n2 + 1
    wide = torch.full((1, 1, 640), -10.0)
    wide[0, 0, 300:305] = torch.tensor([-1.0, -2.0, -3.0, -3.5, -4.0])
    index, score, ok = top_from_chunk_maxima(wide, scores, 3)
    assert index.tolist() == [[300, 301, 302]] and score.tolist() == [[-1.0, -2.0, -3.0]] and ok.all()
