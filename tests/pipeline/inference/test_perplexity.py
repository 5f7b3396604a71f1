"""Teacher-forced valid perplexity on the eval world's real shards and random tiny models."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from model import Transformer
from pipeline.data.batching import token_lengths
from pipeline.data.shard_reader import ShardSet
from pipeline.inference.decoding import load_translator
from pipeline.inference.scored_decoding import perplexity
from tests.helpers.eval_world import VALID
from tests.helpers.models import spm_vocab_size, tiny_model


def _averaged_model(world: Path) -> Transformer:
    """``averaged.pt`` in float64 on CPU: batching must not move the figures beyond rounding."""
    return load_translator(world / "model" / "averaged.pt", "cpu").model.double()


def _per_sentence(model: Transformer, shards: ShardSet) -> tuple[float, int]:
    """(NLL per target token, tokens) from one unpadded sentence at a time, with a plain log-softmax."""
    cfg = model.cfg
    total, tokens = 0.0, 0
    with torch.no_grad():
        for _, src, tgt in shards.iter_rows():
            source = torch.tensor([[*src.tolist(), cfg.eos_id]])  # [1, S]
            decoder_in = torch.tensor([[cfg.bos_id, *tgt.tolist()]])  # [1, T]
            target = torch.tensor([*tgt.tolist(), cfg.eos_id])  # [T]
            log_probs = torch.log_softmax(model(source, decoder_in)[0].double(), dim=-1)  # [T, V]
            total -= float(log_probs[torch.arange(len(target)), target].sum())
            tokens += len(target)
    return total / tokens, tokens


def test_perplexity_matches_a_per_sentence_computation(eval_world: Path) -> None:
    model, shards = _averaged_model(eval_world), ShardSet(eval_world / "shards", "valid")
    figures = perplexity(model, shards, max_tokens=64)
    nll, tokens = _per_sentence(model, shards)
    assert figures["tokens"] == tokens and figures["sentences"] == len(VALID) and figures["skipped"] == 0
    assert figures["nll"] == pytest.approx(nll, rel=1e-9)
    assert figures["ppl"] == pytest.approx(math.exp(nll), rel=1e-9) and figures["ppl"] > 1
    assert figures["ppl"] == math.exp(figures["nll"])


def test_perplexity_does_not_depend_on_the_batch_budget(eval_world: Path) -> None:
    model, shards = _averaged_model(eval_world), ShardSet(eval_world / "shards", "valid")
    one_by_one = perplexity(model, shards, max_tokens=1)  # valid_plan raises it to the longest pair
    together = perplexity(model, shards, max_tokens=4096)
    assert together["ppl"] == pytest.approx(one_by_one["ppl"], rel=1e-6, abs=1e-6)
    assert together["tokens"] == one_by_one["tokens"]


def test_fp32_perplexity_does_not_depend_on_the_batch_budget(eval_world: Path) -> None:
    model = load_translator(eval_world / "model" / "averaged.pt", "cpu").model
    shards = ShardSet(eval_world / "shards", "valid")
    a, b = perplexity(model, shards, max_tokens=1), perplexity(model, shards, max_tokens=4096)
    assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-5)


def test_pairs_longer_than_max_positions_are_skipped_and_counted(eval_world: Path) -> None:
    shards = ShardSet(eval_world / "shards", "valid")
    _, src_len, tgt_len = shards.lengths()
    lengths = token_lengths(src_len, tgt_len)
    limit = int(sorted(lengths)[len(lengths) // 2])  # about half the pairs fit
    model = tiny_model(spm_vocab_size(eval_world / "bpe" / "spm.model"), seed=3, max_positions=limit)
    model.train()
    figures = perplexity(model, shards, max_tokens=64)
    fits = lengths <= limit
    assert 0 < figures["skipped"] == int((~fits).sum()) < len(VALID)
    assert figures["sentences"] == int(fits.sum())
    assert figures["tokens"] == int((tgt_len[fits] + 1).sum())
    assert model.training  # the caller's mode is restored
