"""Time the parts of a base training step in isolation on CUDA: the loss over the 37k vocabulary, attention.

Loss rows: forward + backward of the label-smoothed loss on bf16 logits [N, V] (eager and compiled; the plain
log-softmax loss vs :func:`model.loss.label_smoothed_nll_loss_lean`). Attention rows: forward + backward of
SDPA on [B, H, L, 64] bf16 with a key-padding mask (memory-efficient kernel), without a mask (flash), causal,
and ``torch.nn.attention.varlen`` / flex attention where this torch has them. CUDA events, median of 20 after 5.

Usage:
    python benchmarks/gpu_parts.py --out out/parts.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model.layers import CAUSAL_ATTENTION, CUDA_ATTENTION  # noqa: E402
from model.loss import label_smoothed_nll_loss, label_smoothed_nll_loss_lean  # noqa: E402


def timed(fn, warm: int = 5, reps: int = 20) -> float:
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
    """fwd + bwd ms of each loss variant on [n, v] bf16 logits."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, v, device="cuda", generator=g) * 2).bfloat16().requires_grad_()
    t = torch.randint(4, v, (n,), device="cuda", generator=g)
    t[-n // 8:] = 0
    rows = {}
    for name, fn in (("plain", label_smoothed_nll_loss), ("lean", label_smoothed_nll_loss_lean)):
        for mode, f in (("eager", fn), ("compiled", torch.compile(fn, dynamic=True))):
            def run(f=f):
                loss, _ = f(x, t, 0.1, 0)
                loss.backward()
                x.grad = None
            rows[f"loss {name} {mode} [{n}x{v}]"] = timed(run)
    return rows


def attention_rows(b: int, length: int, h: int = 8, dh: int = 64) -> dict[str, float]:
    """fwd + bwd ms of attention variants on [b, h, length, dh] bf16, ~15% key padding."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (torch.randn(b, h, length, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    lens = torch.randint(length * 7 // 10, length + 1, (b,), device="cuda")
    keep = torch.arange(length, device="cuda")[None, :] < lens[:, None]
    mask = keep[:, None, None, :]
    rows = {}

    def sdpa(backends=CUDA_ATTENTION, **kw):
        def run():
            with sdpa_kernel(backends):
                F.scaled_dot_product_attention(q, k, v, **kw).sum().backward()
        return run
    tag = f"[{b}x{h}x{length}x{dh}]"
    rows[f"sdpa key mask (efficient) {tag}"] = timed(sdpa(attn_mask=mask))
    rows[f"sdpa no mask (flash) {tag}"] = timed(sdpa())
    rows[f"sdpa causal (flash) {tag}"] = timed(sdpa(is_causal=True))
    rows[f"sdpa causal (efficient) {tag}"] = timed(sdpa(CAUSAL_ATTENTION, is_causal=True))
    try:
        from torch.nn.attention.varlen import varlen_attn
        print("varlen_attn", inspect.signature(varlen_attn), flush=True)
        cu = torch.zeros(b + 1, dtype=torch.int32, device="cuda")
        cu[1:] = torch.cumsum(lens, 0)
        total = int(cu[-1])
        qp, kp, vp = (torch.randn(total, h, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                      for _ in range(3))
        rows[f"varlen packed {tag}"] = timed(
            lambda: varlen_attn(qp, kp, vp, cu, cu, length, length).sum().backward())
    except Exception as e:  # noqa: BLE001 - report what this torch lacks
        print("varlen failed:", repr(e)[:300], flush=True)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)

        def pad_mod(bi, hi, qi, ki):
            return ki < lens[bi]
        bm = create_block_mask(pad_mod, b, None, length, length, device="cuda")
        rows[f"flex key mask {tag}"] = timed(lambda: flex(q, k, v, block_mask=bm).sum().backward())
    except Exception as e:  # noqa: BLE001
        print("flex failed:", repr(e)[:300], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Time the parts, print a markdown table, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", nargs="+", default=["loss", "attention"], choices=["loss", "attention"])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_parts.py times CUDA kernels and this machine has no CUDA device; run it on "
                         "a GPU (benchmarks/train.py --device cpu times a whole CPU step)")
    rows = {}
    if "loss" in args.parts:
        rows.update(loss_rows(29000, 37000))
    for b, length in ((900, 32), (450, 64)) if "attention" in args.parts else ():
        rows.update(attention_rows(b, length))
    for k, ms in rows.items():
        print(f"| {k} | {ms:.3f} |", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                                    "ms": rows}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
