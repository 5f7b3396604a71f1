"""The paper's batch on any number of GPUs: global batches planned on real news lengths.

``tests/data/news_lengths.json`` is the (source, target) BPE length histogram of the WMT14 dev news
sets (newstest2008-2013), encoded with the pipeline's own 37k BPE and filtered at the paper
profile's ``encode.max_len``: measured once with ``benchmarks/news_lengths.py``, a one-off script since
deleted (``git show 8fa73ca:benchmarks/news_lengths.py`` has it and its command). Its counts are repeated 20
times to stand for a training corpus (~330k pairs).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.core.config import load_params
from pipeline.core.env import DEFAULT_MAX_TOKENS
from pipeline.data import batching
from tests.helpers.paths import REPO

WORLD_SIZES = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def news():
    data = json.loads((REPO / "tests" / "data" / "news_lengths.json").read_text(encoding="utf-8"))
    hist = np.array(data["histogram"], np.int64)
    counts = hist[:, 2] * 20
    src, tgt = np.repeat(hist[:, 0], counts), np.repeat(hist[:, 1], counts)
    ids = np.arange(len(src), dtype=np.int64) * 3  # gaps, like pairs dropped by encode.max_len
    params = load_params(REPO / "profiles" / "paper.yaml")
    plan = batching.plan_global_batches(ids, batching.token_lengths(src, tgt), tgt + 1,
                                        tokens_per_step=params.train.tokens_per_step, seed=params.seed)
    return {"ids": ids, "src": src, "tgt": tgt, "plan": plan, "params": params}


def test_paper_profile_steps_hold_25k_target_tokens(news):
    plan, budget = news["plan"], news["params"].train.tokens_per_step
    tokens = np.array([b.tgt_tokens for b in plan])
    assert budget == 25000 and len(plan) > 300
    assert abs(tokens.mean() - 25000) <= 0.05 * 25000
    assert tokens.max() <= budget and np.percentile(tokens, 1) >= 0.95 * budget  # all full but the last
    every = np.sort(np.concatenate([b.ids for b in plan]))
    assert every.tolist() == news["ids"].tolist()  # each pair once per epoch


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_world_size_trains_the_same_pairs_in_each_step(news, world):
    """The ranks' forward passes of a step are exactly that step's global batch, on any W."""
    tgt_by_id = dict(zip(news["ids"].tolist(), (news["tgt"] + 1).tolist()))
    budget = DEFAULT_MAX_TOKENS["cuda"]
    for batch in news["plan"]:
        passes = [p for r in range(world) for p in batching.forward_passes(batch, rank=r, world_size=world,
                                                                           max_tokens=budget)]
        got = np.sort(np.concatenate(passes))
        assert got.tolist() == np.sort(batch.ids).tolist()
        assert sum(tgt_by_id[i] for i in got.tolist()) == batch.tgt_tokens
    shapes = batching.forward_shapes(news["plan"], rank=world - 1, world_size=world, max_tokens=budget)
    assert max(n * length for n, length in shapes) <= budget


def test_measured_tokens_of_a_step_do_not_depend_on_the_world_size(news):
    """epoch_steps on every rank: the collated non-pad target tokens of a step sum to its global batch."""
    src, tgt = news["src"], news["tgt"]
    row = {int(i): k for k, i in enumerate(news["ids"])}

    def fetch(ids):
        return [(np.full(src[row[int(i)]], 5, np.uint16), np.full(tgt[row[int(i)]], 6, np.uint16)) for i in ids]

    per_world = {}
    for world in WORLD_SIZES:
        sums = np.zeros(6, np.int64)
        for rank in range(world):
            steps = batching.epoch_steps(news["plan"], fetch, seed=1, epoch=3, start=len(news["plan"]) - 6,
                                         rank=rank, world_size=world, max_tokens=DEFAULT_MAX_TOKENS["cuda"],
                                         pad_id=0, bos_id=2, eos_id=3)
            sums += [sum(b.n_tokens for b in passes) for passes in steps]
        per_world[world] = sums.tolist()
    order = batching.epoch_order(len(news["plan"]), 1, 3)[-6:]
    expected = [news["plan"][g].tgt_tokens for g in order]
    assert all(v == expected for v in per_world.values()), per_world
