"""Beam search against the rule in model/beam.py: hand-computed toy cases, greedy, batch == one by one,
cached == uncached."""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch
from torch import Tensor, nn

from model import Hypothesis, Transformer, TransformerConfig, beam_search, best_hypothesis, length_penalty
import model.beam as beam_module
from model.beam import max_length
from tests.helpers.beam_toy import A, B, BOS, EOS, PAD, FixedProbs  # toy vocabulary: V = 5
from tests.helpers.models import trained_reverser


#            pad   a    bos   eos   b
START = [0.05, 0.45, 0.05, 0.30, 0.15]
AFTER_A = [0.05, 0.20, 0.05, 0.60, 0.10]
AFTER_B = [0.05, 0.30, 0.05, 0.50, 0.10]
SRC = torch.tensor([[A, B, EOS]])


def lp_model() -> FixedProbs:
    return FixedProbs({(): START, (A,): AFTER_A, (B,): AFTER_B}, [0.05, 0.3, 0.05, 0.3, 0.3])


def test_hand_computed_beam_two_and_length_penalty_flips_the_winner() -> None:
    # step 1: candidates a(.45) eos(.30) b(.15): EOS at position 1 < k finishes [] (log .30); live a, b.
    # step 2: a+eos(.27) a+a(.09) b+eos(.075) a+b(.045, flat 4) | b+a(.045, flat 6): a+eos finishes [a];
    #         b+eos is 3rd (not among the first k) and is dropped; 2 finished -> done.
    finished = beam_search(lp_model(), SRC, beam_size=2, max_len_a=0, max_len_b=10, return_finished=True)[0]
    assert [(h.tokens, h.step, h.order) for h in finished] == [([], 1, 0), ([A], 2, 0)]
    assert finished[0].score == pytest.approx(math.log(0.30), abs=1e-12)  # pad/bos excluded, no renormalisation
    assert finished[1].score == pytest.approx(math.log(0.45 * 0.60), abs=1e-12)
    # alpha = 0: raw scores, [] wins; alpha = 1: log(.27) / (7/6) = -1.122 > log(.3) = -1.204, [a] wins
    assert beam_search(lp_model(), SRC, beam_size=2, alpha=0.0, max_len_a=0, max_len_b=10) == [[]]
    assert beam_search(lp_model(), SRC, beam_size=2, alpha=1.0, max_len_a=0, max_len_b=10) == [[A]]
    assert best_hypothesis(finished, 0.0) == [] and best_hypothesis(finished, 1.0) == [A]


def test_greedy_on_toy_model_and_eos_outside_first_k_is_not_finished() -> None:
    # k = 1: step 1 takes a (EOS is 2nd, outside the first k); step 2 a+eos finishes.
    finished = beam_search(lp_model(), SRC, beam_size=1, max_len_a=0, max_len_b=10, return_finished=True)[0]
    assert [(h.tokens, h.step) for h in finished] == [([A], 2)]


def test_ties_go_to_the_lower_flat_index() -> None:
    tie = FixedProbs({(): [0.0, 0.4, 0.0, 0.2, 0.4], (A,): [0, 0, 0, 1, 0], (B,): [0, 0, 0, 1, 0]}, [0, 0, 0, 1, 0])
    assert beam_search(tie, SRC, beam_size=1, max_len_a=0, max_len_b=5) == [[A]]
    swapped = FixedProbs({(): [0.0, 0.4, 0.0, 0.2, 0.4]}, [0, 0, 0, 1, 0])
    fin = beam_search(swapped, SRC, beam_size=2, max_len_a=0, max_len_b=5, return_finished=True)[0]
    # both [a, eos] and [b, eos] have score log .4 at step 2: candidate order a (flat 3) before b (flat 8)
    assert [(h.tokens, h.order) for h in fin] == [([A], 0), ([B], 1)]
    assert beam_search(swapped, SRC, beam_size=2, alpha=0.6, max_len_a=0, max_len_b=5) == [[A]]


def test_max_len_finishes_live_hypotheses_as_they_are() -> None:
    never = FixedProbs({}, [0.0, 0.6, 0.0, 0.1, 0.3])
    # S = 3 non-pad tokens; max_len = floor(1.0 * 3 - 1) = 2
    fin = beam_search(never, torch.tensor([[A, B, EOS, PAD]]), beam_size=2, max_len_a=1.0, max_len_b=-1,
                      return_finished=True)[0]
    # step 1: a b eos; eos is 3rd -> dropped. step 2: aa ab ba bb (flat 1, 4, 6, 9): eos candidates rank
    # 5th/6th; at n == max_len the two live ones finish as they are, in candidate order.
    assert [(h.tokens, h.step, h.order) for h in fin] == [([A, A], 2, 0), ([A, B], 2, 1)]
    assert fin[0].score == pytest.approx(2 * math.log(0.6))
    assert fin[1].final_score(0.6) == pytest.approx(math.log(0.18) / length_penalty(2, 0.6))


def test_empty_source_and_length_rule() -> None:
    m = lp_model()
    src = torch.tensor([[PAD, PAD, PAD], [A, B, EOS]])
    assert beam_search(m, src, beam_size=2, max_len_a=0, max_len_b=10, alpha=1.0) == [[], [A]]
    assert beam_search(m, src[:1], beam_size=3) == [[]]
    assert max_length(0, 1.0, -5) == 1
    assert max_length(3, 1.1, 0.2) == 3  # floor(3.5)
    assert max_length(10, 0.3, 0.0) == 3  # float64: 0.3 * 10 = 3.0000000000000004 -> 3
    with pytest.raises(ValueError, match="beam_size 0: must be an integer from 1 to 64"):
        beam_search(m, src, beam_size=0)


@pytest.mark.parametrize(("beam", "message"), [(65, "beam_size 65: must be an integer from 1 to 64"),
                                               (14, r"beam_size 14: must be at most the vocabulary size \(13 ")])
def test_a_beam_wider_than_the_cap_or_the_vocabulary_is_refused_before_any_step(beam: int, message: str) -> None:
    """Wider than the vocabulary, the search failed mid-way ("stack expects each tensor to be equal size")."""
    m = Transformer(TransformerConfig(vocab_size=13, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_positions=64))
    src = torch.tensor([[5, 6, 7, EOS]])
    with pytest.raises(ValueError, match=message):
        beam_search(m, src, beam_size=beam)
    assert len(beam_search(m, src, beam_size=13, max_len_b=3)) == 1  # the whole vocabulary is a valid beam


# ---- real (random, tiny, float64) models ---------------------------------------------------


def tiny(seed: int, pre_norm: bool = False, vocab: int = 13) -> Transformer:
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=vocab, d_model=16, n_heads=2, d_ff=32, n_layers=2, pre_norm=pre_norm,
                            max_positions=64)
    m = Transformer(cfg).double().eval()
    with torch.no_grad():  # sharper, more varied distributions than the default init gives
        m.embed.weight.mul_(4.0)
        m.embed.weight[EOS].mul_(3.0)  # so that some hypotheses end with EOS before max_len
    return m


def sources(seed: int, n: int = 5) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 4, 2, 7, 3, 5][:n]
    src = torch.full((n, max(lengths) + 2), PAD)
    for i, s in enumerate(lengths):
        src[i, : s - 1] = torch.randint(4, 13, (s - 1,), generator=g)
        src[i, s - 1] = EOS
    return src


def greedy_reference(m: Transformer, src: Tensor, max_len: int) -> list[int]:
    """Full recomputation each step, argmax over all ids but PAD and BOS, stop at EOS or max_len."""
    out = [BOS]
    for _ in range(max_len):
        lp = m(src[None], torch.tensor([out]))[0, -1].log_softmax(-1)
        lp[[PAD, BOS]] = float("-inf")
        tok = int(lp.argmax())
        out.append(tok)
        if tok == EOS:
            break
    return [t for t in out[1:] if t != EOS]


def full_lprobs(m: Transformer, row: Tensor, prefixes: list[list[int]]) -> Tensor:
    """Next-token log-probabilities [L, V] after each prefix, recomputing the whole decoder."""
    return m(row[None].expand(len(prefixes), -1), torch.tensor(prefixes))[:, -1].log_softmax(-1)


def reference_beam(m: nn.Module, row: Tensor, k: int, a: float, b: float, lprobs_fn=full_lprobs
                   ) -> list[tuple[list[int], float, int]]:
    """The rule of model/beam.py transcribed literally: one sentence, lists, no cache, a full recomputation every
    step."""
    n_src = int(row.ne(PAD).sum())
    if n_src == 0:
        return []
    live: list[tuple[list[int], float, int]] = [([BOS], 0.0, 0)]  # tokens, score, candidate position
    finished: list[tuple[int, int, list[int], float]] = []  # step, candidate position, tokens, score
    max_len = max(1, math.floor(a * n_src + b))
    for n in range(1, max_len + 1):
        lp = lprobs_fn(m, row, [toks for toks, _, _ in live])
        vocab = lp.shape[1]
        # sums in the precision of the log-probabilities (float32 for float32 models)
        total = (torch.tensor([s for _, s, _ in live], dtype=lp.dtype)[:, None] + lp).tolist()
        cands = [(total[r][v], r * vocab + v, r, v) for r in range(len(live)) for v in range(vocab)
                 if v not in (PAD, BOS)]
        cands.sort(key=lambda c: (-c[0], c[1]))
        new_live = []
        for j, (score, _, r, v) in enumerate(cands[: 2 * k]):
            if v == EOS and j < k:
                finished.append((n, j, live[r][0][1:], score))
            elif v != EOS and len(new_live) < k:
                new_live.append((live[r][0] + [v], score, j))
        if n == max_len:
            finished.extend((n, j, toks[1:], s) for toks, s, j in new_live)
        live = new_live
        if len(finished) >= k or n == max_len:
            break
    # "finished first" = earlier step, then earlier candidate position (a live hypothesis finished by
    # the max_len rule keeps the position of the candidate it came from)
    return [(toks, s, n) for n, _, toks, s in sorted(finished, key=lambda f: (f[0], f[1]))]


class TiedProbs(FixedProbs):
    """Toy (V = 7 by default) whose next-token weights are small integers drawn from a hash of the prefix:
    many exact ties."""

    def __init__(self, seed: int, vocab: int = 7, weights: tuple[int, ...] = (1, 2, 2, 4)) -> None:
        super().__init__({}, [])
        self.seed, self.vocab, self.weights = seed, vocab, weights

    def probs(self, prefix: list[int]) -> list[float]:
        rng = random.Random(zlib.crc32(repr((self.seed, prefix)).encode()))
        w = [rng.choice(self.weights) for _ in range(self.vocab)]
        w[EOS] = rng.choice([0, 1, 4])
        return [x / sum(w) for x in w]

    def decode_step(self, tokens: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        cache = torch.cat([cache, tokens.view(-1, 1)], dim=1)
        return torch.tensor([self.probs(r) for r in cache.tolist()]).log(), cache


def tied_lprobs(m: TiedProbs, row: Tensor, prefixes: list[list[int]]) -> Tensor:
    """The same float32 log-probabilities the search sees (log in float32, then log-softmax)."""
    return torch.tensor([m.probs(p) for p in prefixes]).log().log_softmax(-1)


@pytest.mark.parametrize("seed", range(8))
def test_exact_ties_in_float32_match_the_literal_rule(seed: int) -> None:
    m = TiedProbs(seed)
    src = torch.tensor([[A, EOS, PAD, PAD, PAD], [A, A, A, B, EOS], [PAD] * 5, [B, B, EOS, PAD, PAD]])
    k = 1 + seed % 4
    got = beam_search(m, src, beam_size=k, max_len_a=1.0, max_len_b=1, return_finished=True)
    for row, hyps in zip(src, got):
        want = reference_beam(m, row, k, 1.0, 1, lprobs_fn=tied_lprobs)
        assert [(h.tokens, h.score, h.step) for h in hyps] == want


def test_ties_in_a_larger_vocabulary_match_the_literal_rule() -> None:
    src = torch.tensor([[A, EOS, PAD, PAD, PAD], [A, A, A, B, EOS], [B, B, EOS, PAD, PAD]])
    for seed in range(6):
        m = TiedProbs(seed, vocab=64, weights=tuple(range(1, 60)))
        got = beam_search(m, src, beam_size=4, max_len_a=1.0, max_len_b=2, return_finished=True)
        for row, hyps in zip(src, got):
            want = reference_beam(m, row, 4, 1.0, 2, lprobs_fn=tied_lprobs)
            assert [(h.tokens, h.score, h.step) for h in hyps] == want


@pytest.mark.parametrize("seed", range(6))
def test_a_steps_candidates_equal_a_literal_sort_with_ties_and_invalid_slots(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, slots, vocab, n2 = 6, 3, 7, 6
    n = slots * vocab
    flat = torch.randint(-3, 1, (b, n), generator=g).float()  # few distinct values: many exact ties
    flat[torch.rand(b, n, generator=g) < [0.1, 0.3, 0.6, 0.9, 0.95, 1.0][seed]] = float("-inf")  # valid may be -inf
    live = torch.randint(0, slots + 1, (b,), generator=g)  # live slots are a prefix
    valid = ((torch.arange(slots) < live[:, None])[:, :, None] & (torch.arange(vocab) % 4 != 0)).view(b, n)
    flat = flat.masked_fill(~valid, float("-inf"))
    tie_rank = torch.where(torch.arange(n) % vocab % 4 != 0, torch.arange(n, 0, -1), 0)  # banned tokens: 0
    index, score, ok = beam_module._top_candidates(flat, tie_rank.int(), valid.sum(1), n2)
    for r in range(b):
        want = sorted((i for i in range(n) if valid[r, i]), key=lambda i: (-flat[r, i].item(), i))[:n2]
        assert index[r, : len(want)].tolist() == want
        assert ok[r].tolist() == [True] * len(want) + [False] * (n2 - len(want))
        assert score[r, : len(want)].tolist() == flat[r, want].tolist()
        assert (score[r, len(want):] == float("-inf")).all()


def test_a_tie_at_the_threshold_goes_to_the_lower_flat_index() -> None:
    flat = torch.tensor([[5.0, 4.0, 3.0, 3.0, 1.0], [5.0, 3.0, 4.0, 3.0, 3.0]])
    index, score, ok = beam_module._top_candidates(flat, torch.arange(5, 0, -1, dtype=torch.int32),
                                                   torch.full((2,), 5), 3)
    assert index.tolist() == [[0, 1, 2], [0, 2, 1]] and score.tolist() == [[5.0, 4.0, 3.0], [5.0, 4.0, 3.0]]
    assert ok.all()


def test_the_steps_log_softmax_overwrites_the_logits_with_torchs_values() -> None:
    logits = torch.randn(64, 8000, generator=torch.Generator().manual_seed(0)) * 4
    logits[:, 100:200] = logits[:, :100]  # ties within a row stay ties
    want = torch.log_softmax(logits, dim=-1)
    got = beam_module._log_softmax_(logits)
    assert got.data_ptr() == logits.data_ptr()
    assert torch.equal(got, want)


def as_tuples(hyps: list[Hypothesis]) -> list[tuple[list[int], int]]:
    return [(h.tokens, h.step) for h in hyps]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_equals_a_simple_greedy_loop(seed: int) -> None:
    m, src = tiny(seed), sources(seed)
    got = beam_search(m, src, beam_size=1, max_len_a=1.0, max_len_b=3)
    want = [greedy_reference(m, row[row.ne(PAD)], max_length(int(row.ne(PAD).sum()), 1.0, 3)) for row in src]
    assert got == want


@pytest.mark.parametrize(("seed", "k", "pre_norm"), [(0, 2, False), (1, 3, False), (2, 5, True), (3, 4, True)])
def test_cached_batched_search_equals_uncached_reference(seed: int, k: int, pre_norm: bool) -> None:
    m, src = tiny(seed, pre_norm), sources(seed)
    got = beam_search(m, src, beam_size=k, max_len_a=1.2, max_len_b=2, return_finished=True)
    for row, hyps in zip(src, got):
        want = reference_beam(m, row, k, 1.2, 2)
        assert as_tuples(hyps) == [(t, n) for t, _, n in want]
        assert [h.score for h in hyps] == pytest.approx([s for _, s, _ in want], abs=1e-9)


@pytest.mark.parametrize(("seed", "k"), [(0, 4), (1, 2), (2, 5)])
def test_a_larger_vocabulary_gives_the_literal_rules_hypotheses(seed: int, k: int) -> None:
    m, src = tiny(seed, vocab=96), sources(seed)
    got = beam_search(m, src, beam_size=k, max_len_a=1.2, max_len_b=2, return_finished=True)
    for row, hyps in zip(src, got):
        want = reference_beam(m, row, k, 1.2, 2)
        assert as_tuples(hyps) == [(t, n) for t, _, n in want]
        assert [h.score for h in hyps] == pytest.approx([s for _, s, _ in want], abs=1e-9)


@pytest.mark.parametrize("k", [1, 4])
def test_batched_equals_one_sentence_at_a_time(k: int) -> None:
    m, src = tiny(7), sources(7, n=6)
    batched = beam_search(m, src, beam_size=k, max_len_a=1.0, max_len_b=4, return_finished=True)
    for row, hyps in zip(src, batched):
        alone = beam_search(m, row[None, : int(row.ne(PAD).sum())], beam_size=k, max_len_a=1.0, max_len_b=4,
                            return_finished=True)[0]
        assert as_tuples(hyps) == as_tuples(alone)
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], abs=1e-12)
    steps = {h.step for hyps in batched for h in hyps}
    assert len(steps) > 2, "sentences should finish at different steps for this test to bite"
    best = beam_search(m, src, beam_size=k, alpha=0.6, max_len_a=1.0, max_len_b=4)
    assert best == [best_hypothesis(h, 0.6) for h in batched]
    assert all(BOS not in h and EOS not in h and PAD not in h for h in best)


def test_search_restores_training_mode_and_float32_runs() -> None:
    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=13, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_positions=64))
    m.train()
    out = beam_search(m, sources(0), beam_size=3)
    assert m.training and len(out) == 5
    with pytest.raises(ValueError, match="exceeds the model's max_positions 64"):
        beam_search(m, sources(0), beam_size=2, max_len_b=100)


@pytest.mark.slow
def test_a_trained_model_gives_the_literal_rules_hypotheses_in_a_batch() -> None:
    m = trained_reverser()
    g = torch.Generator().manual_seed(3)
    lengths = [2, 7, 3, 6, 4, 5, 2, 7]
    src = torch.full((len(lengths), 8), PAD)
    for i, s in enumerate(lengths):
        src[i, :s] = torch.randint(4, 13, (s,), generator=g)
        src[i, s] = EOS
    got = beam_search(m, src, beam_size=4, max_len_a=1.0, max_len_b=4, return_finished=True)
    for row, hyps in zip(src, got):
        want = reference_beam(m, row, 4, 1.0, 4)
        assert as_tuples(hyps) == [(t, n) for t, _, n in want]
        assert [h.score for h in hyps] == pytest.approx([s for _, s, _ in want], abs=1e-9)
    best = [best_hypothesis(h, 0.6) for h in got]
    # realistic outputs: the model learnt to reverse well enough that every answer ends with EOS long before
    # max_len = n + 5 (a random model's run to max_len), on average within one token of the source's length
    # (how well it learnt varies with the CPU's float arithmetic: one answer 2 tokens short was seen on one)
    assert all(len(h) <= n + 2 for h, n in zip(best, lengths)), (best, lengths)
    assert sum(abs(len(h) - n) for h, n in zip(best, lengths)) <= len(lengths), (best, lengths)


class RowCounter(nn.Module):
    """Wraps a model and records how many rows each decode step gets and whether cross K/V were copied."""

    def __init__(self, inner: Transformer) -> None:
        super().__init__()
        self.inner, self.cfg, self.rows, self.cross_moves = inner, inner.cfg, [], 0

    def encode(self, src: Tensor):
        return self.inner.encode(src)

    def init_state(self, enc, beam: int, capacity: int):
        return self.inner.init_state(enc, beam, capacity)

    def decode_step(self, tokens: Tensor, state):
        self.rows.append(tokens.numel())
        return self.inner.decode_step(tokens, state)

    def reorder_state(self, state, rows: Tensor, sentences: Tensor | None):
        before = [k.data_ptr() for k in state.cross_k]
        state = self.inner.reorder_state(state, rows, sentences)
        self.cross_moves += [k.data_ptr() for k in state.cross_k] != before
        return state


def test_finished_sentences_leave_the_batch_and_beams_share_cross_attention() -> None:
    m = RowCounter(trained_reverser())
    src = torch.tensor([[5, EOS, PAD, PAD, PAD, PAD, PAD, PAD], [5, 6, 7, 8, 9, 10, 11, EOS]])
    beam_search(m, src, beam_size=3, max_len_a=1.0, max_len_b=4)
    # the short sentence is done after ~2 steps; from then on only the long one's 3 rows are fed
    assert m.rows[:2] == [2, 6] and m.rows[-1] == 3 and m.rows.count(3) >= 5, m.rows  # [BOS] once per sentence
    assert m.cross_moves == 1, "cross-attention K/V move only when a sentence leaves, never per step"
