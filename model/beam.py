"""Batched beam search with a GNMT length penalty, by an exact rule that two correct implementations agree on.

This docstring states the default rule, fairseq's; ``rule="t2t"`` is tensor2tensor's (:mod:`model.beam_rules`).

Per step n (tokens generated so far, including this one) every live hypothesis is extended by every token but
PAD and BOS (log-softmax in fp32 or wider, no renormalisation); candidates are ordered by (score desc,
flat index asc) with flat index = live rank × V + token, and the first 2k are taken. In that order,
an EOS candidate among the first k finishes (final score = score / lp(n), lp(n) = ((5 + n) / 6)^α),
non-EOS candidates become live until k are live; at n == max_len every live hypothesis finishes as it
is. A sentence is done with ≥ k finished hypotheses or after max_len. The answer is the best final
score, ties to the one finished first (earlier step, then earlier candidate position; a hypothesis
finished by the max_len rule keeps the position of the candidate that made it live, so at the last
step an EOS candidate and a live one are ordered by candidate position, not by rule). Pruning uses raw scores
only, so the finished set does not depend on α.

The model needs ``cfg`` and the decoding methods of :class:`~model.transformer.Transformer`; the logits
``decode_step`` returns may be overwritten and must be fp32 or wider (bf16 logits would tie nearby candidates).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.beam_rules import FairseqStop, Hypothesis, Step, T2TStop, best_hypothesis, check_rule, penalties
from model.config import beam_size_problem, max_length
from model.precision import wide


def _first_k(mask: Tensor, values: list[Tensor], k: int, fill: list[float | int]) -> tuple[Tensor, list[Tensor]]:
    """Pack the entries where ``mask`` [B, M] is True into k slots, keeping order: (ok [B, k], values [B, k] each)."""
    b = mask.shape[0]
    rank = mask.cumsum(1) - 1
    keep = mask & (rank < k)
    slot = torch.where(keep, rank, k)
    out = []
    for v, f in zip(values, fill):
        base = v.new_full((b, k + 1), f)
        out.append(base.scatter_(1, slot, v)[:, :k])
    ok = torch.arange(k, device=mask.device)[None, :] < keep.sum(1, keepdim=True)
    return ok, out


#: Per step, the device tensors of the sentences still searching: (``sent``, the :class:`Step`, ``fin_live``),
#: moved to the host once at the end.
History = list[tuple[Tensor, Step, Tensor]]


def _stacked(hist: History, name: str, n_sent: int) -> Tensor:
    """Field ``name`` of the steps (``fin_live`` or one of :class:`Step`) as one [steps, n_sent, k] tensor over all
    sentences (zeros where a sentence had left)."""
    rows = [(sent, fin_live if name == "fin_live" else getattr(st, name)) for sent, st, fin_live in hist]
    return torch.stack([x.new_zeros((n_sent,) + x.shape[1:]).index_copy_(0, sent, x) for sent, x in rows])


def _backtrack(org: Tensor, tok: Tensor, sent: Tensor, slot: Tensor, length: Tensor) -> Tensor:
    """Tokens [H, max length] of H hypotheses, followed back through ``org``/``tok`` [T, n_sent, k]."""
    out = tok.new_zeros(len(sent), int(length.max()) if len(sent) else 0)
    slot = slot.clone()
    for step in range(out.shape[1], 0, -1):
        on = (length >= step).nonzero().view(-1)
        b, s = sent[on], slot[on]
        out[on, step - 1] = tok[step - 1, b, s]
        slot[on] = org[step - 1, b, s]
    return out


def _rebuild(hist: History, n_sent: int) -> list[list[Hypothesis]]:
    """Every finished hypothesis from the history, backtracked for all sentences at once on the host."""
    if not hist:
        return [[] for _ in range(n_sent)]

    def host(name: str) -> Tensor:
        return _stacked(hist, name, n_sent).cpu()

    org, tok = host("live_org"), host("live_tok")
    parts = []
    for flags, start, pos, score, extra in (("eos_fin", "eos_org", None, "eos_score", 0),
                                            ("fin_live", None, "live_pos", "live_score", 1)):
        step, b, j = host(flags).nonzero(as_tuple=True)
        slot = j if start is None else host(start)[step, b, j]
        key = j if pos is None else host(pos)[step, b, j]
        parts.append((step, b, slot, step + extra, key, host(score)[step, b, j]))
    step, b, slot, length, key, score = (torch.cat(cols) for cols in zip(*parts))
    tokens = _backtrack(org, tok, b, slot, length)
    # sentence, then step, then candidate position: stable sorts from the last key to the first
    perm = key.argsort(stable=True)
    for col in (step, b):
        perm = perm[col[perm].argsort(stable=True)]
    result: list[list[Hypothesis]] = [[] for _ in range(n_sent)]
    prev, order = (-1, -1), 0
    rows = tokens[perm].tolist()
    for r, i, s, n, sc in zip(rows, b[perm].tolist(), step[perm].tolist(), length[perm].tolist(), score[perm].tolist()):
        order = order + 1 if (i, s) == prev else 0
        prev = (i, s)
        result[i].append(Hypothesis(r[:n], float(sc), s + 1, order))
    return result


def _top_candidates(flat: Tensor, tie_rank: Tensor, n_valid: Tensor, n2: int) -> tuple[Tensor, Tensor, Tensor]:
    """(index, score, ok) [B, n2] of the first ``n2`` candidates of ``flat`` [B, N] by (score desc, flat index asc).

    ``topk`` finds the threshold, a second ``topk`` over ``tie_rank`` [N] the lowest flat indices equal to it.
    """
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


def _extend(scores: Tensor, lprobs: Tensor, live_ok: Tensor, banned: Tensor, k: int, eos: int, pad: int,
            eos_width: int) -> Step:
    """Rank every extension of the live hypotheses; EOS candidates among the first ``eos_width`` finish, the first
    k others stay live.

    Args:
        scores: [B, slots] raw scores of the slots, -inf for a slot without a live hypothesis.
        lprobs: [B, slots, V] next-token log-probabilities, overwritten in place with the candidates' scores.
        live_ok: [B, slots] which slots hold a live hypothesis (a prefix of the slots).
        banned: [2] the ids that never extend a hypothesis (PAD and BOS).
    """
    n_sent, slots, vocab = lprobs.shape
    n = slots * vocab
    n2 = min(2 * k, n)
    lprobs.index_fill_(2, banned, float("-inf"))
    flat = lprobs.add_(scores[:, :, None]).view(n_sent, n)  # in place
    rank = torch.arange(n, 0, -1, device=flat.device, dtype=torch.int32).view(slots, vocab)
    tie_rank = rank.index_fill_(1, banned, 0).view(n)
    index, cand_score, cand_ok = _top_candidates(flat, tie_rank, live_ok.sum(1) * (vocab - banned.numel()), n2)
    origin, token = index // vocab, index % vocab
    is_eos = token.eq(eos)
    m = index.shape[1]
    pos = torch.arange(m, device=index.device).expand(n_sent, m)
    ok, (org, tok, live_score, live_pos) = _first_k(
        ~is_eos & cand_ok, [origin, token, cand_score, pos], k, [0, pad, float("-inf"), m]
    )
    fin = [is_eos & cand_ok, origin, cand_score]
    if m < eos_width:  # t2t's 2k at a first step over fewer tokens
        fin = [torch.cat([x, x.new_full((n_sent, eos_width - m), f)], 1) for x, f in zip(fin, (0, 0, float("-inf")))]
    return Step(*(x[:, :eos_width] for x in fin), ok, org, tok, live_score, live_pos)


def _log_softmax_(logits: Tensor) -> Tensor:
    """Log-softmax over the last dimension of ``logits`` [N, V], in place on CPU (benchmarks/RESULTS.md)."""
    if logits.device.type != "cpu":
        return torch.log_softmax(logits, dim=-1)
    return torch.log_softmax(logits, dim=-1, out=logits)


def _max_lens(src: Tensor, pad: int, a: float, b: float, limit: int | None) -> list[int]:
    """Per sentence max_len (0 for an empty source), checked against the position table."""
    max_lens = [max_length(s, a, b) if s > 0 else 0 for s in src.ne(pad).sum(1).tolist()]
    if limit is not None and max(max_lens, default=0) > limit:
        raise ValueError(
            f"max_len {max(max_lens)} exceeds the model's max_positions {limit}: lower max_len_a/max_len_b "
            "or drop overlong sources"
        )
    return max_lens


@torch.no_grad()
def beam_search_finished(
    model: nn.Module, src: Tensor, beam_size: int = 4, max_len_a: float = 1.0, max_len_b: float = 50, *,
    rule: str = "fairseq", alpha: float = 0.6
) -> list[list[Hypothesis]]:
    """Run the search and return every sentence's finished set, in finishing order, with raw scores.

    Args:
        model: see the module docstring; put it in eval mode first (dropout would randomise the search).
        src: [B, S] int64 source ids, right-padded with ``pad_id``.
        beam_size: k in 1 .. :data:`~model.config.MAX_BEAM_SIZE` and at most the vocabulary size (1: greedy).
        max_len_a: a in max_len = max(1, floor(a · S + b)), S = non-pad tokens of the row; ``max_len_b``: b.
        rule: ``"fairseq"`` (every hypothesis that finished; the same for every α) or ``"t2t"`` (the k best by
            ``alpha``, or the best live one if none finished: :mod:`model.beam_rules`).
        alpha: the length-penalty exponent the ``t2t`` rule searches with (unused by ``fairseq``).
    """
    check_rule(rule)
    problem = beam_size_problem(beam_size, getattr(model.cfg, "vocab_size", 0))
    if problem:
        raise ValueError(f"beam_size {beam_size!r:.40}: {problem}")
    cfg, n_sent, k, dev = model.cfg, src.shape[0], beam_size, src.device
    max_lens = _max_lens(src, cfg.pad_id, max_len_a, max_len_b, getattr(cfg, "max_positions", None))
    if n_sent == 0 or max(max_lens) == 0:
        return [[] for _ in range(n_sent)]
    sent = torch.tensor([i for i, m in enumerate(max_lens) if m > 0], device=dev)  # empty sources never enter
    state = model.init_state(model.encode(src.index_select(0, sent)), k, max(max_lens))
    max_len_t = torch.tensor(max_lens, device=dev).index_select(0, sent)
    stop = (FairseqStop(k, len(sent), dev) if rule == "fairseq"
            else T2TStop(k, alpha, penalties([m for m in max_lens if m > 0], alpha, dev)))
    # step 1 extends one slot per sentence ([BOS]); every later step k slots
    last = torch.full((len(sent),), cfg.bos_id, dtype=torch.long, device=dev)
    live_ok = torch.ones(len(sent), 1, dtype=torch.bool, device=dev)
    banned = torch.tensor(sorted({cfg.pad_id, cfg.bos_id}), device=dev)
    scores = None
    hist: History = []
    for n in range(1, max(max_lens) + 1):
        logits, state = model.decode_step(last, state)
        lprobs = _log_softmax_(wide(logits)).view(len(sent), live_ok.shape[1], -1)  # fp32 stays fp32
        scores = lprobs.new_zeros(len(sent), 1) if scores is None else scores
        st = _extend(scores, lprobs, live_ok, banned, k, cfg.eos_id, cfg.pad_id, stop.eos_width)
        fin_live, done = stop.step(st, n, max_len_t.eq(n))
        hist.append((sent, st, fin_live))
        keep = (~done).nonzero().view(-1)  # the one host sync per step: who goes on
        if keep.numel() == 0:
            break
        leaving = keep.numel() < len(sent)
        if leaving:  # done sentences leave the batch
            sent, max_len_t = sent[keep], max_len_t[keep]
            stop.keep(keep)
            st = Step(*(x.index_select(0, keep) for x in st))
        rows = (keep[:, None] * live_ok.shape[1] + st.live_org).view(-1)  # old row of each new row
        state = model.reorder_state(state, rows, keep if leaving else None)
        last, scores, live_ok = st.live_tok.reshape(-1), st.live_score, st.live_ok
    return [stop.select(f) for f in _rebuild(hist, n_sent)]


def beam_search(
    model: nn.Module,
    src: Tensor,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: float = 50,
    return_finished: bool = False,
    *,
    rule: str = "fairseq",
) -> list[list[int]] | list[list[Hypothesis]]:
    """Translate a batch with beam search by ``rule`` (``"fairseq"``, this module's docstring, or ``"t2t"``:
    :mod:`model.beam_rules`), restoring the model's mode.

    Per sentence, the best hypothesis's ids by length-penalty exponent ``alpha`` (or, with ``return_finished``,
    :func:`beam_search_finished`'s lists).
    """
    was_training = model.training
    model.eval()
    try:
        finished = beam_search_finished(model, src, beam_size, max_len_a, max_len_b, rule=rule, alpha=alpha)
    finally:
        model.train(was_training)
    return finished if return_finished else [best_hypothesis(f, alpha) for f in finished]
