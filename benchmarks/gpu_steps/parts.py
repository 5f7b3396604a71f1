"""``benchmarks/gpu.py parts``: the parts of a base training step timed in isolation on CUDA (described in
``benchmarks/gpu.py``). CUDA events, median of 20 after 5."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model.layers import CAUSAL_ATTENTION, CUDA_ATTENTION
from model.loss import label_smoothed_nll_loss, label_smoothed_nll_loss_lean

log = logging.getLogger("gpu")


def timed(fn: Callable[[], object], warm: int = 5, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` (CUDA events)."""
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def loss_rows(n: int, v: int) -> dict[str, float]:
    """fwd + bwd ms of each loss variant on [n, v] bf16 logits, eager and compiled."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, v, device="cuda", generator=g) * 2).bfloat16().requires_grad_()
    t = torch.randint(4, v, (n,), device="cuda", generator=g)
    t[-n // 8:] = 0
    rows = {}
    for name, fn in (("plain", label_smoothed_nll_loss), ("lean", label_smoothed_nll_loss_lean)):
        for mode, f in (("eager", fn), ("compiled", torch.compile(fn, dynamic=True))):
            def run(f=f) -> None:
                loss, _ = f(x, t, 0.1, 0)
                loss.backward()
                x.grad = None
            rows[f"loss {name} {mode} [{n}x{v}]"] = timed(run)
    return rows


def attention_rows(b: int, length: int, h: int = 8, dh: int = 64) -> dict[str, float]:
    """fwd + bwd ms of attention variants on [b, h, length, dh] bf16 with key padding (varlen, flex if present)."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (torch.randn(b, h, length, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    lens = torch.randint(length * 7 // 10, length + 1, (b,), device="cuda")
    keep = torch.arange(length, device="cuda")[None, :] < lens[:, None]
    rows = {}

    def sdpa(backends=CUDA_ATTENTION, **kw) -> Callable[[], None]:
        def run() -> None:
            with sdpa_kernel(backends):
                F.scaled_dot_product_attention(q, k, v, **kw).sum().backward()
        return run
    tag = f"[{b}x{h}x{length}x{dh}]"
    rows[f"sdpa key mask (efficient) {tag}"] = timed(sdpa(attn_mask=keep[:, None, None, :]))
    rows[f"sdpa no mask (flash) {tag}"] = timed(sdpa())
    rows[f"sdpa causal (flash) {tag}"] = timed(sdpa(is_causal=True))
    rows[f"sdpa causal (efficient) {tag}"] = timed(sdpa(CAUSAL_ATTENTION, is_causal=True))
    try:
        from torch.nn.attention.varlen import varlen_attn
        cu = torch.zeros(b + 1, dtype=torch.int32, device="cuda")
        cu[1:] = torch.cumsum(lens, 0)
        qp, kp, vp = (torch.randn(int(cu[-1]), h, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                      for _ in range(3))
        rows[f"varlen packed {tag}"] = timed(lambda: varlen_attn(qp, kp, vp, cu, cu, length, length).sum().backward())
    except Exception as exc:  # noqa: BLE001 - report what this torch lacks
        log.warning("varlen failed: %s", repr(exc)[:300])
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        bm = create_block_mask(lambda bi, hi, qi, ki: ki < lens[bi], b, None, length, length, device="cuda")
        rows[f"flex key mask {tag}"] = timed(lambda: flex(q, k, v, block_mask=bm).sum().backward())
    except Exception as exc:  # noqa: BLE001
        log.warning("flex failed: %s", repr(exc)[:300])
    return rows


def run() -> dict[str, object]:
    """The loss rows ([29000 x 37000] logits) and the attention rows, each logged as a markdown table row."""
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py parts times CUDA kernels and this machine has no CUDA device; run it on "
                         "a GPU (benchmarks/train.py --device cpu times a whole CPU step)")
    rows = {**loss_rows(29000, 37000), **attention_rows(900, 32), **attention_rows(450, 64)}
    for key, ms in rows.items():
        log.info("| %s | %.3f |", key, ms)
    return {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "ms": rows}
