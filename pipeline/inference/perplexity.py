"""Teacher-forced per-token perplexity of a model on a split of the shards (no label smoothing).

The paper's Table 3 reports perplexity "per-wordpiece" on the development set: here the NLL of every
non-pad target token (the BPE pieces and the EOS of each sentence; the decoder input is BOS + the
pieces) is summed over the split and ``ppl = exp(sum / tokens)``. Batches are planned as the train
stage's validation plans them (:func:`pipeline.data.batching.valid_plan`): a token budget, length
order, and pairs longer than the model's ``max_positions`` skipped and counted. Padding never
enters the sums, so the figure does not depend on the budget.
"""

from __future__ import annotations

import logging
import math

import torch

from model import Transformer, autocast, label_smoothed_nll_loss
from pipeline.core.errors import DataError
from pipeline.data import batching
from pipeline.data.shards import ShardSet

log = logging.getLogger(__name__)


@torch.no_grad()
def perplexity(model: Transformer, shards: ShardSet, *, max_tokens: int) -> dict[str, float]:
    """Per-token NLL and perplexity of ``model`` on every pair of ``shards`` that fits the model.

    The model runs on the device of its parameters, in eval mode (its mode is restored afterwards),
    under :func:`model.autocast` as validation during training does; the NLL comes from
    :func:`model.label_smoothed_nll_loss` with ``epsilon=0`` (log-softmax in fp32 or wider).

    Args:
        model: the Transformer to score.
        shards: a split (valid/test) of ``paths.shards``.
        max_tokens: batch budget in padded tokens (``sentences × longest``; see ``valid_plan``).

    Returns:
        ``{"nll": mean NLL per target token (nats), "ppl": exp(nll), "tokens": target tokens scored
        (EOS included), "sentences": pairs scored, "skipped": pairs longer than max_positions}``.

    Raises:
        DataError: no pair of the split fits the model (nothing to score).
    """
    cfg = model.cfg
    device = next(model.parameters()).device
    ids, src_len, tgt_len = shards.lengths()
    plan = batching.valid_plan(ids, batching.token_lengths(src_len, tgt_len), max_tokens=max_tokens,
                               max_positions=cfg.max_positions)
    sentences = sum(len(b) for b in plan)
    was_training = model.training
    model.eval()
    nll_sum, tokens = 0.0, 0
    try:
        for batch_ids in plan:
            batch = batching.collate(shards.fetch(batch_ids), pad_id=cfg.pad_id, bos_id=cfg.bos_id,
                                     eos_id=cfg.eos_id).to(device)
            with autocast(device):
                logits = model(batch.src, batch.tgt_in)  # [B, T, V]
            _, nll = label_smoothed_nll_loss(logits, batch.tgt_out, epsilon=0.0, ignore_index=cfg.pad_id)
            nll_sum += float(nll)
            tokens += batch.n_tokens
    finally:
        model.train(was_training)
    if tokens == 0:
        raise DataError(f"{shards.root}: split {shards.split!r} has no pair that fits model.max_positions "
                        f"({cfg.max_positions}); nothing to compute a perplexity on: check `dvc repro encode`")
    nll = nll_sum / tokens
    log.info("%s perplexity %.3f (NLL %.4f over %d tokens, %d sentences, %d skipped)", shards.split,
             math.exp(nll), nll, tokens, sentences, len(ids) - sentences)
    return {"nll": nll, "ppl": math.exp(nll), "tokens": tokens, "sentences": sentences,
            "skipped": int(len(ids) - sentences)}
