"""The first 2k candidates of a beam-search step in the order of the rule in ``model/beam.py``: score
descending, then flat index (live rank × V + token) ascending, exactly, ties included.

Three ways to the same answer: :func:`top_with_tie_pass` for any input (two ``topk`` and stable sorts,
no host sync: the GPU path); :func:`top_without_boundary_ties`, one ``topk`` when no row ties at its
threshold (CPU); :func:`top_from_chunk_maxima`, the same without scanning every candidate with
``topk`` (CPU, tried first: ``topk`` over B × k·V scores was a sixth of a small model's CPU decoding).
"""

from __future__ import annotations

import torch
from torch import Tensor

Found = tuple[Tensor, Tensor, Tensor]  # (flat index [B, n2], score [B, n2], ok [B, n2] bool) in candidate order


def top_candidates(flat: Tensor, tie_rank: Tensor, n_valid: Tensor, n2: int) -> Found:
    """First ``n2`` candidates by (score desc, flat index asc), exactly (ties included).

    ``topk`` finds the threshold (the n2-th largest score) and every candidate above it; which of
    several candidates equal to the threshold it returns is unspecified, so those are taken again by a
    second ``topk`` over ``tie_rank``: the lowest flat indices first. No pass over the candidates needs
    a cumulative sum or a host sync. On CPU a batch with no tie at any row's threshold (the usual case
    for a trained model) takes one ``topk`` instead (:func:`top_without_boundary_ties`).

    Args:
        flat: [B, N] candidate scores, -inf where invalid (a valid candidate may score -inf too).
        tie_rank: [N] int32, N - flat index for a token that may extend a hypothesis, 0 for one that
            may not. Invalid candidates of empty slots keep their rank: the slots holding live
            hypotheses come first, so a valid candidate always precedes them.
        n_valid: [B] number of valid candidates per row.
        n2: how many to take (<= N).

    Returns:
        (index [B, n2] flat indices, score [B, n2], ok [B, n2] bool) in candidate order; invalid
        slots (fewer valid candidates than n2) are at the end with ok False and score -inf.
    """
    if flat.device.type == "cpu":
        found = top_without_boundary_ties(flat, n2)
        if found is not None:
            return found
    return top_with_tie_pass(flat, tie_rank, n_valid, n2)


def top_with_tie_pass(flat: Tensor, tie_rank: Tensor, n_valid: Tensor, n2: int) -> Found:
    """:func:`top_candidates` for any input (the threshold's ties taken by a second ``topk``)."""
    n = flat.shape[1]
    top, top_index = flat.topk(n2, dim=1)
    thr = top[:, -1:]
    above = top > thr  # [B, n2]: every candidate above the threshold is among topk's
    n_tie = n_valid.clamp(max=n2) - above.sum(1)  # [B] how many candidates equal to it to take
    tie_key, tie_index = torch.where(flat == thr, tie_rank, 0).topk(n2, dim=1)
    tie_ok = (tie_key > 0) & (torch.arange(n2, device=flat.device) < n_tie[:, None])
    index = torch.cat([top_index, tie_index], dim=1)  # [B, 2·n2]
    ok = torch.cat([above, tie_ok], dim=1)
    score = flat.gather(1, index)
    # order (ok first, score desc, index asc): stable sorts from the last key to the first
    perm = index.masked_fill(~ok, n).sort(dim=1, stable=True).indices
    for key in (score, ok.to(torch.int8)):  # an int8 key: sorting bool tensors is not supported everywhere
        perm = perm.gather(1, key.gather(1, perm).sort(dim=1, descending=True, stable=True).indices)
    perm = perm[:, :n2]
    ok = ok.gather(1, perm)
    return index.gather(1, perm), score.gather(1, perm).masked_fill(~ok, float("-inf")), ok


def top_without_boundary_ties(flat: Tensor, n2: int) -> Found | None:
    """:func:`top_candidates` in one ``topk`` when no row has a tie at its threshold, else None.

    When the (n2+1)-th score of every row is below its n2-th, the first n2 are exactly the candidates
    >= the threshold (all finite, so all valid) and only their order needs the index tie-break. The
    check reads a device value on the host: used on CPU only, where that costs nothing.
    """
    if n2 >= flat.shape[1]:
        return None
    top, top_index = flat.topk(n2 + 1, dim=1)
    if not bool((top[:, n2] < top[:, n2 - 1]).all()):
        return None
    return _in_candidate_order(top_index[:, :n2], top[:, :n2])


def _in_candidate_order(index: Tensor, score: Tensor) -> Found:
    """[B, n2] candidates (flat index, score) put in the rule's order: index ascending, then a stable sort by
    score descending."""
    index, perm = index.sort(dim=1, stable=True)
    score = score.gather(1, perm)
    order = score.sort(dim=1, descending=True, stable=True).indices
    return index.gather(1, order), score.gather(1, order), torch.ones_like(index, dtype=torch.bool)


def chunk_count(vocab: int) -> int | None:
    """The largest divisor w of ``vocab`` in [8, min(64, V / 2)] (None if it has none): a hypothesis's V
    scores form w chunks for :func:`top_from_chunk_maxima`, chunk j holding the tokens t ≡ j (mod w), so
    that the maxima are an elementwise max over V / w contiguous rows of w scores (8000 → 64 chunks of 125)."""
    return next((w for w in range(min(64, vocab // 2), 7, -1) if vocab % w == 0), None)


def top_from_chunk_maxima(lprobs: Tensor, scores: Tensor, n2: int) -> Found | None:
    """:func:`top_without_boundary_ties` of ``flat = (lprobs + scores[:, :, None]).view(B, slots · V)`` without
    ``flat`` or a ``topk`` over it; None where that returns None, and possibly in a few other cases (a tie
    among the scores looked at).

    Each hypothesis's V scores are split into chunks (:func:`chunk_count`); the n2 + 1 chunks with the
    largest maxima (maximum + the slot's score: x ↦ x + s is monotone in floating point too) are taken
    whole and their candidates ranked. Exact when the n2-th and (n2+1)-th of those are distinct: a
    candidate outside them scoring at least the n2-th would lie in a chunk whose maximum is at least that,
    so each of the n2 + 1 chunks taken would hold a candidate at least as high, and the (n2+1)-th would
    equal the n2-th. The scores are ``lprobs[i] + scores`` per candidate, the same float operation as ``flat``'s.

    Args:
        lprobs: [B, slots, V] log-probabilities (banned tokens -inf), not modified.
        scores: [B, slots] the slots' raw scores, -inf for an empty slot.
        n2: how many to take.
    """
    n_sent, slots, vocab = lprobs.shape
    w = chunk_count(vocab)
    if w is None or slots * w <= n2 + 1:
        return None
    peaks = lprobs.view(n_sent, slots, vocab // w, w).amax(2).add_(scores[:, :, None]).view(n_sent, -1)
    chunk = peaks.topk(n2 + 1, dim=1).indices  # [B, n2 + 1], chunk q = slot q // w, tokens ≡ q % w (mod w)
    slot = chunk // w
    first = slot * vocab + chunk % w  # flat index of each chunk's first candidate
    index = (first[:, :, None] + torch.arange(0, vocab, w, device=lprobs.device)).view(n_sent, -1)
    cand = lprobs.view(n_sent, -1).gather(1, index).view(n_sent, n2 + 1, -1)
    cand = cand.add_(scores.gather(1, slot)[:, :, None]).view(n_sent, -1)  # each chunk's slot score, broadcast
    top, at = cand.topk(n2 + 1, dim=1)
    if not bool((top[:, n2] < top[:, n2 - 1]).all()):
        return None
    return _in_candidate_order(index.gather(1, at[:, :n2]), top[:, :n2])
