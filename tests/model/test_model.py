"""The Transformer: config, size, causality, padding invariance, cached decoding, learning a toy task."""

from __future__ import annotations

import copy

import time

import pytest
import torch

from model import EncoderOut, Transformer, TransformerConfig

PAD, BOS, EOS = 0, 2, 3


def tiny_cfg(**kw: object) -> TransformerConfig:
    base: dict[str, object] = {"vocab_size": 23, "d_model": 16, "n_heads": 4, "d_ff": 32, "n_layers": 2,
                               "max_positions": 64}
    base.update(kw)
    return TransformerConfig(**base)  # type: ignore[arg-type]


def tiny_model(seed: int = 0, **kw: object) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_cfg(**kw)).double().eval()


def rand_tokens(b: int, t: int, v: int = 23) -> torch.Tensor:
    return torch.randint(4, v, (b, t))


# ---- config ---------------------------------------------------------------------------------


def test_config_round_trip_and_errors() -> None:
    cfg = tiny_cfg(pre_norm=True)
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown TransformerConfig keys \['bogus'\]"):
        TransformerConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        tiny_cfg(d_model=30)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        tiny_cfg(dropout=1.0)
    with pytest.raises(ValueError, match="eos_id must be an int in"):
        tiny_cfg(eos_id=23)
    with pytest.raises(ValueError, match="must differ"):
        tiny_cfg(bos_id=0)


def test_defaults_are_the_papers_base_model_with_its_reference_codes_dropouts() -> None:
    """§3 and §5.4, and attention/ReLU dropout 0.0 as tensor2tensor's transformer_base_v1 and fairseq's
    transformer_wmt_en_de (the paper names dropout on residual branches and embeddings only)."""
    cfg = TransformerConfig(vocab_size=37000)
    assert (cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.n_layers) == (512, 8, 2048, 6)
    assert (cfg.dropout, cfg.attn_dropout, cfg.ffn_dropout) == (0.1, 0.0, 0.0)


def test_base_model_has_63m_parameters() -> None:
    with torch.device("meta"):
        m = Transformer(TransformerConfig(vocab_size=37000))
    n = sum(p.numel() for p in m.parameters())
    assert abs(n - 63.0e6) <= 0.5e6, n
    assert not any(k.startswith("positions") for k in m.state_dict()), "positions are derived, not saved"


@pytest.mark.parametrize("pre_norm", [False, True])
def test_weight_count_is_what_the_built_model_holds(pre_norm: bool) -> None:
    """The params check bounds a model by this count before anything is built (model.config.MAX_WEIGHTS)."""
    from model.config import MAX_WEIGHTS

    cfg = TransformerConfig(vocab_size=37, d_model=16, n_heads=2, d_ff=24, n_layers=3, max_positions=50,
                            pre_norm=pre_norm)
    m = Transformer(cfg)
    assert cfg.weight_count() == sum(p.numel() for p in m.parameters()) + m.positions.numel()
    big = TransformerConfig(d_model=1024, n_heads=16, d_ff=4096, n_layers=6)  # the paper's big model
    assert 213e6 < big.weight_count(37000) < MAX_WEIGHTS / 16


def test_init_pad_row_zero_and_embedding_scale() -> None:
    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=4000, d_model=64, n_heads=4, d_ff=128, n_layers=1))
    w = m.embed.weight
    assert torch.all(w[PAD] == 0)
    assert abs(w[1:].std().item() - 64**-0.5) < 0.01
    x = torch.randn(3, 64)
    torch.testing.assert_close(m.project(x), x @ w.T)  # output projection is the shared embedding
    assert sum(p is w for p in m.parameters()) == 1


# ---- invariances ----------------------------------------------------------------------------


@pytest.mark.parametrize("pre_norm", [False, True])
def test_future_target_tokens_do_not_change_earlier_logits(pre_norm: bool) -> None:
    m = tiny_model(pre_norm=pre_norm)
    src, tgt = rand_tokens(3, 7), rand_tokens(3, 6)
    tgt[:, 0] = BOS
    changed = tgt.clone()
    changed[:, 4:] = rand_tokens(3, 2)
    a, b = m(src, tgt), m(src, changed)
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize("pre_norm", [False, True])
def test_extra_padding_does_not_change_results(pre_norm: bool) -> None:
    m = tiny_model(pre_norm=pre_norm)
    src = torch.tensor([[5, 6, 7, 8, EOS], [9, 10, EOS, PAD, PAD]])
    tgt = torch.tensor([[BOS, 11, 12, 13], [BOS, 14, PAD, PAD]])
    ref = m(src, tgt)
    padded = m(torch.nn.functional.pad(src, (0, 4)), torch.nn.functional.pad(tgt, (0, 3)))
    torch.testing.assert_close(padded[:, :4], ref, rtol=0, atol=1e-12)
    # a padded row equals the same sentence alone
    alone = m(src[1:, :3], tgt[1:, :2])
    torch.testing.assert_close(ref[1:, :2], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize("pre_norm", [False, True])
@torch.no_grad()
def test_cached_incremental_decoding_equals_full(pre_norm: bool) -> None:
    m = tiny_model(seed=1, pre_norm=pre_norm)
    src = torch.tensor([[5, 6, 7, 8, EOS], [9, 10, EOS, PAD, PAD]])
    tgt = torch.cat([torch.full((2, 1), BOS), rand_tokens(2, 5)], dim=1)
    full = m(src, tgt)
    enc = m.encode(src)
    state = m.init_state(enc, beam=1, capacity=tgt.shape[1] + 1)
    for t in range(tgt.shape[1]):
        logits, state = m.decode_step(tgt[:, t], state)
        torch.testing.assert_close(logits, full[:, t], rtol=0, atol=1e-10)
    assert state.length == tgt.shape[1]
    # reordering the state reorders the rows; dropping a sentence keeps the other's rows exact
    rev = torch.tensor([1, 0])
    swapped = Transformer.reorder_state(copy.deepcopy(state), rev, rev)
    step, _ = m.decode_step(torch.tensor([[7], [8]]), swapped)
    step_ref, _ = m.decode_step(torch.tensor([8, 7]), copy.deepcopy(state))
    torch.testing.assert_close(step, step_ref[rev], rtol=0, atol=1e-12)
    second = Transformer.reorder_state(state, torch.tensor([1]), torch.tensor([1]))
    alone, _ = m.decode_step(torch.tensor([7]), second)
    torch.testing.assert_close(alone, step_ref[1:], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=f"holds {tgt.shape[1] + 1} tokens"):
        m.decode_step(torch.tensor([7]), second)


@pytest.mark.parametrize("beam", [1, 3])
@torch.no_grad()
def test_beam_rows_share_their_sentence_cross_attention(beam: int) -> None:
    """N = B·beam rows against one K/V per sentence equal every row decoded on its own."""
    m = tiny_model(seed=2)
    src = torch.tensor([[5, 6, 7, 8, EOS], [9, 10, EOS, PAD, PAD]])
    tokens = rand_tokens(2 * beam, 3)
    state = m.init_state(m.encode(src), beam=beam, capacity=4)
    logits, state = m.decode_step(torch.full((2 * beam,), BOS), state)
    for t in range(3):
        logits, state = m.decode_step(tokens[:, t], state)
    for r in range(2 * beam):
        tgt = torch.cat([torch.tensor([BOS]), tokens[r]])[None]
        want = m(src[r // beam : r // beam + 1], tgt)[0, -1]
        torch.testing.assert_close(logits[r], want, rtol=0, atol=1e-10)


def test_decode_project_equals_forward_and_encode_masks() -> None:
    m = tiny_model()
    src = torch.tensor([[5, 6, EOS], [7, EOS, PAD]])
    tgt = torch.tensor([[BOS, 4, 5], [BOS, 6, PAD]])
    torch.testing.assert_close(m.project(m.decode(tgt, m.encode(src))), m(src, tgt), rtol=0, atol=0)
    enc = m.encode(src)
    assert isinstance(enc, EncoderOut)
    assert enc.memory.shape == (2, 3, 16)
    assert enc.pad_mask.tolist() == [[False, False, False], [False, False, True]]


def test_fully_padded_source_gives_finite_outputs_and_gradients() -> None:
    torch.manual_seed(0)
    m = Transformer(tiny_cfg(dropout=0.0, attn_dropout=0.0, ffn_dropout=0.0))
    src = torch.tensor([[5, 6, EOS], [PAD, PAD, PAD]])
    tgt = torch.tensor([[BOS, 4, 5], [BOS, 6, PAD]])
    out = m(src, tgt)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_cross_attention_weights_are_probabilities_over_real_tokens() -> None:
    m = tiny_model()
    src = torch.tensor([5, 6, 7, EOS, PAD])
    tgt = torch.tensor([BOS, 4, 5, 6])
    w = m.cross_attention(src, tgt, layer=-1)
    assert w.shape == (4, 4, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(4, 4, dtype=w.dtype))
    assert torch.all(w[..., 4] == 0)
    assert torch.equal(w, m.cross_attention(src, tgt, layer=1))


def test_training_mode_uses_dropout_and_eval_is_deterministic() -> None:
    torch.manual_seed(0)
    m = Transformer(tiny_cfg(dropout=0.3))
    src, tgt = rand_tokens(2, 5), rand_tokens(2, 4)
    assert not torch.equal(m(src, tgt), m(src, tgt))
    m.eval()
    assert torch.equal(m(src, tgt), m(src, tgt))


# ---- learning ------------------------------------------------------------------------------


@pytest.mark.parametrize("pre_norm", [False, True])
def test_tiny_model_learns_to_reverse(pre_norm: bool) -> None:
    from model import label_smoothed_nll_loss

    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=12, d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.0, attn_dropout=0.0,
        ffn_dropout=0.0, pre_norm=pre_norm, max_positions=16,
    )
    m = Transformer(cfg)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3, betas=(0.9, 0.98))
    start, per_token = time.monotonic(), float("inf")
    for _ in range(600):
        body = torch.randint(4, 12, (64, 5))
        src = torch.cat([body, torch.full((64, 1), EOS)], dim=1)
        rev = body.flip(1)
        tgt_in = torch.cat([torch.full((64, 1), BOS), rev], dim=1)
        target = torch.cat([rev, torch.full((64, 1), EOS)], dim=1)
        loss, nll = label_smoothed_nll_loss(m(src, tgt_in), target, epsilon=0.0, ignore_index=PAD)
        opt.zero_grad()
        (loss / target.numel()).backward()
        opt.step()
        per_token = nll.item() / target.numel()
        if per_token < 0.02:
            break
    assert per_token < 0.05, per_token
    assert time.monotonic() - start < 20


@pytest.mark.slow
def test_forward_traces_as_one_graph() -> None:
    """No data-dependent Python control flow: dynamo captures the forward without graph breaks."""
    m = tiny_model().float()
    src, tgt = rand_tokens(2, 5), rand_tokens(2, 4)
    src[1, 3:] = PAD
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(src, tgt), m(src, tgt))
