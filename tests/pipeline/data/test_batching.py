"""The batch planner: global batches, forward-pass budgets, determinism, per-epoch shuffles, the rank split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.core.errors import DataError
from pipeline.data import batching


def reference_plan(ids, lengths, max_tokens, seed):
    """The obviously-correct version: permute, stable sort, add while the padded cost fits."""
    perm = np.random.default_rng([seed, batching._PLAN_STREAM]).permutation(len(ids))
    order = sorted(perm.tolist(), key=lambda i: lengths[i])  # Python's sort is stable
    batches, cur, longest = [], [], 0
    for i in order:
        if cur and (len(cur) + 1) * max(longest, lengths[i]) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(ids[i])
        longest = max(longest, lengths[i])
    if cur:
        batches.append(cur)
    return batches


def corpus(n=2000, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(n * 2, n, replace=False)).astype(np.int64)  # gaps, like encode.max_len drops
    src = rng.integers(0, 80, n).astype(np.int32)
    tgt = rng.integers(0, 80, n).astype(np.int32)
    return ids, batching.token_lengths(src, tgt), src, tgt


@pytest.mark.parametrize("max_tokens", [81, 200, 1000, 4096])
def test_fast_plan_equals_the_reference(max_tokens):
    ids, lengths, _, _ = corpus()
    fast = batching.plan_batches(ids, lengths, max_tokens=max_tokens, seed=7)
    slow = reference_plan(ids.tolist(), lengths.tolist(), max_tokens, 7)
    assert [b.tolist() for b in fast] == slow


def test_budget_counts_padding_and_every_example_appears_once():
    ids, lengths, src, tgt = corpus()
    by_id = dict(zip(ids.tolist(), lengths.tolist()))
    batches = batching.plan_batches(ids, lengths, max_tokens=500, seed=1)
    assert all(len(b) * max(by_id[i] for i in b) <= 500 for b in batches)
    assert sorted(np.concatenate(batches).tolist()) == ids.tolist()
    assert lengths.tolist() == (np.maximum(src, tgt) + 1).tolist()  # EOS / BOS counted


def test_plan_is_deterministic_and_seeded():
    ids, lengths, _, _ = corpus()
    a = batching.plan_batches(ids, lengths, max_tokens=300, seed=3)
    b = batching.plan_batches(ids, lengths, max_tokens=300, seed=3)
    c = batching.plan_batches(ids, lengths, max_tokens=300, seed=4)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]  # ties broken by the seeded permutation


def test_a_pair_longer_than_the_budget_is_a_clear_error():
    with pytest.raises(DataError, match=r"example id 11 needs 90 tokens > NMT_MAX_TOKENS \(64\); raise NMT_MAX_TOKENS"):
        batching.plan_batches(np.array([10, 11]), np.array([5, 90]), max_tokens=64, seed=0)


def test_epoch_order_shuffles_per_epoch_deterministically():
    a0, a1 = batching.epoch_order(50, 1, 0), batching.epoch_order(50, 1, 1)
    assert sorted(a0.tolist()) == list(range(50))
    assert a0.tolist() != a1.tolist()
    assert a0.tolist() == batching.epoch_order(50, 1, 0).tolist()


def reference_global_plan(ids, lengths, tgt_tokens, budget, seed):
    """The obviously-correct version: permute, stable sort, add while the target tokens fit."""
    perm = np.random.default_rng([seed, batching._PLAN_STREAM]).permutation(len(ids))
    order = sorted(perm.tolist(), key=lambda i: lengths[i])
    batches, cur, total = [], [], 0
    for i in order:
        if cur and total + tgt_tokens[i] > budget:
            batches.append(cur)
            cur, total = [], 0
        cur.append(ids[i])
        total += tgt_tokens[i]
    return batches + [cur] if cur else batches


@pytest.mark.parametrize("budget", [81, 500, 3000])
def test_global_plan_equals_the_reference_and_counts_target_tokens(budget):
    ids, lengths, _, tgt = corpus()
    plan = batching.plan_global_batches(ids, lengths, tgt + 1, tokens_per_step=budget, seed=5)
    slow = reference_global_plan(ids.tolist(), lengths.tolist(), (tgt + 1).tolist(), budget, 5)
    assert [b.ids.tolist() for b in plan] == slow
    by_id = dict(zip(ids.tolist(), (tgt + 1).tolist()))
    assert all(b.tgt_tokens == sum(by_id[i] for i in b.ids.tolist()) <= budget for b in plan)
    assert all(np.all(np.diff(b.lengths) >= 0) for b in plan)  # shortest first: shares stay alike


def test_a_target_longer_than_a_step_is_a_clear_error():
    with pytest.raises(DataError, match=r"example id 11 has 90 target tokens > train.tokens_per_step \(64\)"):
        batching.plan_global_batches(np.array([10, 11]), np.array([5, 90]), np.array([5, 90]), tokens_per_step=64,
                                     seed=0)


@pytest.mark.parametrize(("world", "max_tokens"), [(1, 4096), (1, 100), (3, 200), (8, 81)])
def test_rank_shares_are_disjoint_cover_the_batch_and_fit_the_budget(world, max_tokens):
    ids, lengths, _, tgt = corpus()
    by_id = dict(zip(ids.tolist(), lengths.tolist()))
    for batch in batching.plan_global_batches(ids, lengths, tgt + 1, tokens_per_step=1500, seed=2):
        passes = [p for r in range(world)
                  for p in batching.forward_passes(batch, rank=r, world_size=world, max_tokens=max_tokens)]
        got = np.concatenate(passes).tolist()
        assert sorted(got) == sorted(batch.ids.tolist()) and len(got) == len(set(got))
        assert all(len(p) * max(by_id[i] for i in p.tolist()) <= max_tokens for p in passes)


def test_a_rank_without_pairs_gets_no_forward_pass():
    batch = batching.GlobalBatch(np.array([4, 9]), np.array([3, 5]), 6)
    assert batching.forward_passes(batch, rank=2, world_size=4, max_tokens=100) == []
    assert batching.forward_passes(batch, rank=1, world_size=4, max_tokens=100)[0].tolist() == [9]


def test_collate_follows_the_sequence_conventions():
    pairs = [(np.array([7, 8], np.uint16), np.array([9], np.uint16)), (np.array([5], np.uint16),
                                                                          np.array([6, 6, 6], np.uint16))]
    b = batching.collate(pairs, pad_id=0, bos_id=2, eos_id=3, index=4)
    assert b.src.tolist() == [[7, 8, 3], [5, 3, 0]]
    assert b.tgt_in.tolist() == [[2, 9, 0, 0], [2, 6, 6, 6]]
    assert b.tgt_out.tolist() == [[9, 3, 0, 0], [6, 6, 6, 3]]
    assert b.n_tokens == 6 == int((b.tgt_out != 0).sum()) and b.index == 4 and b.src.dtype == torch.int64
    assert b.n_src == 5 == int((b.src != 0).sum()) and b.to(torch.device("cpu")).n_src == 5


def test_prefetch_yields_in_order_and_reraises_errors():
    table = {i: (np.array([i + 4], np.uint16), np.array([i + 4, i + 4], np.uint16)) for i in range(10)}
    fetch = lambda ids: [table[int(i)] for i in ids]  # noqa: E731
    jobs = [((0, 0), np.array([1, 2])), ((0, 1), np.array([5])), ((2, 0), np.array([3]))]
    got = list(batching.prefetch(fetch, jobs, pad_id=0, bos_id=2, eos_id=3))
    assert [(g.index, g.forward) for g in got] == [(0, 0), (0, 1), (2, 0)]
    assert got[2].src.tolist() == [[7, 3]]
    with pytest.raises(KeyError):
        list(batching.prefetch(fetch, [((0, 0), np.array([99]))], pad_id=0, bos_id=2, eos_id=3))


def test_valid_plan_skips_pairs_beyond_the_position_table_and_fits_long_ones(caplog):
    ids, lengths = np.arange(6), np.array([3, 12, 5, 40, 9, 7])
    kept = np.concatenate(batching.valid_plan(ids, lengths, max_tokens=4, max_positions=10))
    assert sorted(kept.tolist()) == [0, 2, 4, 5] and "validation skips 2 of 6 pairs" in caplog.text
    full = batching.valid_plan(ids, lengths, max_tokens=4, max_positions=64)  # budget grows to 40
    assert sorted(np.concatenate(full).tolist()) == list(range(6))
