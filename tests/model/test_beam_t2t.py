"""``beam_search(..., rule="t2t")`` against a literal port of tensor2tensor's beam search (utils/beam_search.py):
one sentence, plain lists, a full decoder recomputation per step, float64."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from model import Hypothesis, Transformer, TransformerConfig, beam_search, best_hypothesis

from tests.helpers.beam_toy import A, B, BOS, EOS, PAD, FixedProbs
INF = 1.0 * 1e7  # tensor2tensor's "INF"


def t2t_port(m: Transformer, row: Tensor, beam_size: int, alpha: float, decode_length: int) -> list[int]:
    """tensor2tensor's ``beam_search`` (``stop_early=True``) for one source ``row``, step by step as written there;
    the only change is this project's vocabulary: PAD and BOS never extend a hypothesis."""
    src = row[row.ne(PAD)][None]
    alive_seq = [[BOS] for _ in range(beam_size)]
    alive_log_probs = [0.0] + [-math.inf] * (beam_size - 1)
    finished_seq = [[BOS] for _ in range(beam_size)]
    finished_scores, finished_flags = [-INF] * beam_size, [False] * beam_size

    def top_k(scores: list[float], k: int) -> list[int]:  # tf.nn.top_k: ties to the lower index
        return sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:k]

    def is_finished(i: int) -> bool:  # _is_finished's negation of "go on"
        max_length_penalty = ((5.0 + decode_length) / 6.0) ** alpha
        lower_bound_alive_scores = alive_log_probs[0] / max_length_penalty
        lowest = min(s * float(f) for s, f in zip(finished_scores, finished_flags))
        lowest += (1.0 - float(any(finished_flags))) * -INF
        return not (i < decode_length and not lowest > lower_bound_alive_scores)

    i = 0
    while not is_finished(i):
        # grow_topk
        with torch.no_grad():
            logits = m(src.expand(beam_size, -1), torch.tensor(alive_seq))[:, -1]
        candidate_log_probs = logits.log_softmax(-1)
        candidate_log_probs[:, [PAD, BOS]] = -math.inf
        log_probs = candidate_log_probs + torch.tensor(alive_log_probs, dtype=torch.float64)[:, None]
        length_penalty = ((5.0 + (i + 1)) / 6.0) ** alpha
        flat_curr_scores = (log_probs / length_penalty).view(-1).tolist()
        vocab = log_probs.shape[1]
        topk_ids = top_k(flat_curr_scores, 2 * beam_size)
        topk_scores = [flat_curr_scores[j] for j in topk_ids]
        topk_log_probs = [s * length_penalty for s in topk_scores]
        topk_seq = [alive_seq[j // vocab] + [j % vocab] for j in topk_ids]
        topk_finished = [j % vocab == EOS for j in topk_ids]
        # grow_alive
        alive = top_k([s + float(f) * -INF for s, f in zip(topk_scores, topk_finished)], beam_size)
        alive_seq, alive_log_probs = [topk_seq[j] for j in alive], [topk_log_probs[j] for j in alive]
        # grow_finished
        curr = [s + (1.0 - float(f)) * -INF for s, f in zip(topk_scores, topk_finished)]
        seqs, scores, flags = finished_seq + topk_seq, finished_scores + curr, finished_flags + topk_finished
        keep = top_k(scores, beam_size)
        finished_seq = [seqs[j] for j in keep]
        finished_scores, finished_flags = [scores[j] for j in keep], [flags[j] for j in keep]
        i += 1
    best = finished_seq[0] if any(finished_flags) else alive_seq[0]
    return [t for t in best[1:] if t != EOS]


def tiny(seed: int, vocab: int = 16) -> Transformer:
    """A random float64 model whose EOS embedding is scaled so that some hypotheses end before max_len."""
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=vocab, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_positions=64)
    m = Transformer(cfg).double().eval()
    with torch.no_grad():
        m.embed.weight.mul_(4.0)
        m.embed.weight[EOS].mul_(3.0)
    return m


def sources(seed: int, vocab: int = 16, n: int = 6) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 4, 2, 7, 3, 5, 6, 2][:n]
    src = torch.full((n, max(lengths) + 2), PAD)
    for i, s in enumerate(lengths):
        src[i, : s - 1] = torch.randint(5, vocab, (s - 1,), generator=g)
        src[i, s - 1] = EOS
    return src


def decode_length(row: Tensor, a: float, b: float) -> int:
    return max(1, math.floor(a * int(row.ne(PAD).sum()) + b))


CASES = [(seed, k, alpha, a, b) for seed, k in [(0, 1), (3, 2), (5, 3), (6, 4), (10, 5), (4, 4)]
         for alpha in (0.6, 1.0) for a, b in [(1.0, 3), (0.5, 1)]]


@pytest.mark.parametrize(("seed", "k", "alpha", "a", "b"), CASES)
def test_the_t2t_rule_equals_the_literal_port_of_tensor2tensor(seed: int, k: int, alpha: float, a: float,
                                                                b: float) -> None:
    m, src = tiny(seed), sources(seed)
    got = beam_search(m, src, k, alpha, a, b, rule="t2t")
    assert got == [t2t_port(m, row, k, alpha, decode_length(row, a, b)) for row in src]


def test_the_cases_differ_from_the_fairseq_rule_and_reach_every_ending() -> None:
    """The port test bites: on its cases fairseq's rule answers otherwise, and t2t's answers end both ways."""
    differ = with_eos = without_eos = 0
    for seed, k, alpha, a, b in CASES:
        m, src = tiny(seed), sources(seed)
        t2t = beam_search(m, src, k, alpha, a, b, return_finished=True, rule="t2t")
        fairseq = beam_search(m, src, k, alpha, a, b)
        differ += sum(best_hypothesis(h, alpha) != f for h, f in zip(t2t, fairseq))
        for row, hyps in zip(src, t2t):
            n = decode_length(row, a, b)
            alive = len(hyps) == 1 and hyps[0].step == n and len(hyps[0].tokens) == n  # nothing finished
            without_eos, with_eos = without_eos + alive, with_eos + (not alive)
    assert differ >= 20 and with_eos >= 40 and without_eos >= 20, (differ, with_eos, without_eos)


@pytest.mark.parametrize(("k", "alpha"), [(1, 0.6), (4, 0.6), (3, 1.0)])
def test_batched_equals_one_sentence_at_a_time(k: int, alpha: float) -> None:
    """As tests/model/test_beam.py checks it for the fairseq rule."""
    m, src = tiny(5), sources(5, n=8)
    batched = beam_search(m, src, k, alpha, 1.0, 4, return_finished=True, rule="t2t")
    for row, hyps in zip(src, batched):
        alone = beam_search(m, row[None, : int(row.ne(PAD).sum())], k, alpha, 1.0, 4, return_finished=True,
                            rule="t2t")[0]
        assert [(h.tokens, h.step, h.order) for h in hyps] == [(h.tokens, h.step, h.order) for h in alone]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], abs=1e-12)
        assert 1 <= len(hyps) <= k  # the finished set, or the best live hypothesis
    assert len({h.step for hyps in batched for h in hyps}) > 2, "sentences should finish at different steps"
    assert beam_search(m, src, k, alpha, 1.0, 4, rule="t2t") == [best_hypothesis(h, alpha) for h in batched]


def test_an_eos_outside_the_first_k_finishes_and_the_search_stops_by_the_bound() -> None:
    #            pad   a     bos   eos   b
    m = FixedProbs({(): [0.05, 0.45, 0.05, 0.30, 0.15], (A,): [0.05, 0.20, 0.05, 0.60, 0.10]},
                   [0.05, 0.3, 0.05, 0.3, 0.3])
    src = torch.tensor([[A, B, EOS]])
    # k = 1, alpha = 0: step 1 takes a (.45) and eos (.30, 2nd of 2k = 2): [] finishes (fairseq drops it);
    # step 2: a+eos (.27) does not beat [] in the finished set of one, and log .3 > log .09 (the live a+a, at
    # any length) ends the search: the answer is [] where fairseq's rule answers [a]
    finished = beam_search(m, src, 1, 0.0, 0, 10, return_finished=True, rule="t2t")[0]
    assert [(h.tokens, h.step) for h in finished] == [([], 1)]
    assert finished[0].score == pytest.approx(math.log(0.30), abs=1e-12)
    assert beam_search(m, src, 1, 0.0, 0, 10) == [[A]]


def test_with_nothing_finished_the_best_live_hypothesis_is_the_answer() -> None:
    never = FixedProbs({}, [0.0, 0.6, 0.0, 0.05, 0.35])  # EOS is never among the first 2k = 2
    got = beam_search(never, torch.tensor([[A, B, EOS]]), 1, 0.6, 0, 3, return_finished=True, rule="t2t")[0]
    assert got == [Hypothesis([A, A, A], pytest.approx(3 * math.log(0.6)), 3, 0)]


@pytest.mark.parametrize("rule", ["T2T", "beam", None, 1])
def test_an_unknown_rule_is_refused_in_one_line(rule: object) -> None:
    with pytest.raises(ValueError, match=r"^rule .*: must be one of 'fairseq', 't2t'$"):
        beam_search(tiny(0), sources(0), 2, rule=rule)  # type: ignore[arg-type]
