"""Label-smoothed loss (plain and lean) and the inverse square-root learning-rate schedule."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from model import inverse_sqrt_lr, label_smoothed_nll_loss, label_smoothed_nll_loss_lean

PAD = 0


def batch(seed: int = 0, v: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    logits = torch.randn(3, 5, v, dtype=torch.float64)
    target = torch.randint(1, v, (3, 5))
    target[1, 3:] = PAD
    target[2, 1:] = PAD
    return logits, target


def test_epsilon_zero_equals_cross_entropy_sum() -> None:
    logits, target = batch()
    loss, nll = label_smoothed_nll_loss(logits, target, epsilon=0.0, ignore_index=PAD)
    ce = F.cross_entropy(logits.view(-1, 11), target.view(-1), ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, ce)
    torch.testing.assert_close(nll, ce)


def test_smoothing_spreads_epsilon_over_the_whole_vocabulary() -> None:
    logits, target = batch()
    eps = 0.1
    loss, nll = label_smoothed_nll_loss(logits, target, epsilon=eps, ignore_index=PAD)
    lp = logits.log_softmax(-1)
    expected, expected_nll = 0.0, 0.0
    for b in range(3):
        for t in range(5):
            y = int(target[b, t])
            if y == PAD:
                continue
            expected_nll += -lp[b, t, y].item()
            # the smoothed target distribution: (1 - eps) on y plus eps / V on every id (pad included)
            q = torch.full((11,), eps / 11, dtype=torch.float64)
            q[y] += 1 - eps
            expected += -(q * lp[b, t]).sum().item()
    assert math.isclose(loss.item(), expected, rel_tol=1e-12)
    assert math.isclose(nll.item(), expected_nll, rel_tol=1e-12)
    # the ids that carry eps / V include EOS and the target itself; pad-target positions contribute 0
    assert torch.equal(label_smoothed_nll_loss(logits, torch.zeros_like(target))[0], torch.zeros((), dtype=lp.dtype))


def test_padded_batch_equals_sum_of_items() -> None:
    logits, target = batch()
    total, total_nll = label_smoothed_nll_loss(logits, target, epsilon=0.1, ignore_index=PAD)
    lengths = [5, 3, 1]
    parts = [label_smoothed_nll_loss(logits[i : i + 1, :n], target[i : i + 1, :n], 0.1, PAD) for i, n in
             enumerate(lengths)]
    torch.testing.assert_close(total, sum(p[0] for p in parts))
    torch.testing.assert_close(total_nll, sum(p[1] for p in parts))


def test_log_softmax_runs_in_fp32_for_half_logits() -> None:
    logits, target = batch()
    half = logits.to(torch.bfloat16)
    loss, _ = label_smoothed_nll_loss(half, target)
    assert loss.dtype == torch.float32
    ref, _ = label_smoothed_nll_loss(half.double(), target)
    assert math.isclose(loss.item(), ref.item(), rel_tol=1e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_lean_equals_plain_in_value_and_gradient(dtype: torch.dtype, tol: float, eps: float) -> None:
    """Both sums and d(0.7 loss + 0.3 nll)/d logits: pad rows get zero gradient, the gradient keeps the dtype."""
    logits, target = batch(seed=2, v=37)
    logits = (logits * 4).to(dtype)
    sums, grads = [], []
    for fn in (label_smoothed_nll_loss, label_smoothed_nll_loss_lean):
        x = logits.clone().requires_grad_()
        loss, nll = fn(x, target, epsilon=eps, ignore_index=PAD)
        (0.7 * loss + 0.3 * nll).backward()
        sums.append((loss, nll))
        grads.append(x.grad)
    for a, b in zip(*sums):
        assert a.dtype == b.dtype == torch.promote_types(dtype, torch.float32)
        assert math.isclose(a.item(), b.item(), rel_tol=tol)
    assert grads[1].dtype == dtype and torch.equal(grads[1][target.eq(PAD)], torch.zeros_like(grads[1][target.eq(PAD)]))
    torch.testing.assert_close(grads[1].double(), grads[0].double(), rtol=tol, atol=tol if dtype != torch.bfloat16
                               else 1e-2)


def test_lean_gradients_pass_gradcheck_and_it_compiles() -> None:
    logits, target = batch(seed=3)
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: label_smoothed_nll_loss_lean(t, target, 0.1, PAD), (x,))
    compiled = torch.compile(label_smoothed_nll_loss_lean, backend="eager", fullgraph=True)  # traceable, no break
    got, want = compiled(x, target, 0.1, PAD), label_smoothed_nll_loss(x, target, 0.1, PAD)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got[0], x)[0]
    torch.testing.assert_close(g_got, torch.autograd.grad(want[0], x)[0])


def test_bad_inputs_are_named() -> None:
    logits, target = batch()
    for fn in (label_smoothed_nll_loss, label_smoothed_nll_loss_lean):
        with pytest.raises(ValueError, match=r"epsilon must be in \[0, 1\), got 1.5"):
            fn(logits, target, epsilon=1.5)
        with pytest.raises(ValueError, match=r"logits \(3, 5, 11\) do not match target \(3, 4\)"):
            fn(logits, target[:, :4])


# ---- schedule -------------------------------------------------------------------------------


def test_schedule_formula_and_peak_at_warmup() -> None:
    d, w = 512, 4000
    assert inverse_sqrt_lr(1, d, w) == pytest.approx(d**-0.5 * w**-1.5)
    assert inverse_sqrt_lr(w, d, w) == pytest.approx(d**-0.5 * w**-0.5)
    assert inverse_sqrt_lr(4 * w, d, w) == pytest.approx(inverse_sqrt_lr(w, d, w) / 2)
    assert inverse_sqrt_lr(w, d, w, scale=2.0) == pytest.approx(2 * inverse_sqrt_lr(w, d, w))
    values = [inverse_sqrt_lr(s, d, w) for s in range(1, 3 * w)]
    peak = max(range(len(values)), key=values.__getitem__) + 1
    assert peak == w
    assert all(a < b for a, b in itertools.pairwise(values[:w]))
    assert all(a > b for a, b in itertools.pairwise(values[w - 1 :]))


def test_schedule_rejects_step_zero() -> None:
    with pytest.raises(ValueError, match="counts from 1, got 0"):
        inverse_sqrt_lr(0)
    with pytest.raises(ValueError, match="warmup"):
        inverse_sqrt_lr(1, warmup=0)
