"""The output layer + label-smoothed loss of one batch, fwd + bwd: ours (log-softmax loss eager, lean loss
compiled as the train stage runs it) against Liger-Kernel's fused linear cross-entropy and Apple's
cut-cross-entropy, each checked against an fp32 reference (loss and both gradients, relative error).

    python -m benchmarks.gpu_steps.losses --out losses.json [--dry-run]   # dry run: CPU, small, ours only

Hidden states [N, d] and the tied output matrix [V, d] in bf16, 1/8 of the targets padding (ignored);
label smoothing ε = 0.1 (cut-cross-entropy has none: it is timed and checked at ε = 0 and cannot replace ours).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from model.loss import label_smoothed_nll_loss, label_smoothed_nll_loss_lean

log = logging.getLogger("gpu")
EPS, PAD = 0.1, 0
Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def ours(loss_fn: Callable, eps: float = EPS) -> Loss:
    """logits = h @ W^T, then ``loss_fn``'s loss sum."""
    def f(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return loss_fn(h @ w.t(), t, eps, PAD)[0]
    return f


def candidates(cuda: bool) -> dict[str, tuple[Loss, float]]:
    """name -> (loss, its ε); the libraries only on CUDA and where they import."""
    found: dict[str, tuple[Loss, float]] = {
        "ours: log-softmax loss, eager": (ours(label_smoothed_nll_loss), EPS),
        "ours: lean loss, compiled (the stage's NMT_COMPILE path)":
            (torch.compile(ours(label_smoothed_nll_loss_lean), dynamic=True), EPS)}
    if not cuda:
        return found
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=PAD, label_smoothing=EPS, reduction="sum")
        found["liger-kernel fused linear cross-entropy"] = (lambda h, w, t: liger(w, h, t), EPS)
    except Exception as exc:  # noqa: BLE001 - reported, the rest still timed
        log.warning("liger-kernel: %r", exc)
    try:
        from cut_cross_entropy import linear_cross_entropy
        found["cut-cross-entropy (no label smoothing: eps 0)"] = (
            lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=PAD, reduction="sum"), 0.0)
        found["ours: lean loss, compiled, eps 0 (beside cut-cross-entropy)"] = (
            torch.compile(ours(label_smoothed_nll_loss_lean, 0.0), dynamic=True), 0.0)
    except Exception as exc:  # noqa: BLE001
        log.warning("cut-cross-entropy: %r", exc)
    return found


def _run(fn: Loss, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    h.grad = w.grad = None
    loss = fn(h, w, t)
    loss.backward()
    return float(loss), h.grad.float(), w.grad.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _ms(fn: Callable[[], object], cuda: bool, warm: int = 3, reps: int = 15) -> float:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - start) * 1e3)
    return statistics.median(out)


def run(n: int, d: int, v: int, device: str) -> dict[str, object]:
    """Every candidate on one batch: its error against the fp32 reference of its ε, ms, peak memory."""
    cuda = device == "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, d, device=device, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device=device, generator=g) * d ** -0.5).bfloat16().requires_grad_()
    t = torch.randint(4, v, (n,), device=device, generator=g)
    t[-n // 8:] = PAD
    refs: dict[float, tuple[float, torch.Tensor, torch.Tensor]] = {}
    rows = {}
    for name, (fn, eps) in candidates(cuda).items():
        if eps not in refs:
            hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
            refs[eps] = _run(ours(label_smoothed_nll_loss, eps), hf, wf, t)
        try:
            loss, gh, gw = _run(fn, h, w, t)
            ref = refs[eps]
            row = {"eps": eps, "loss_rel_err": abs(loss - ref[0]) / abs(ref[0]), "grad_h_rel_err": _rel(gh, ref[1]),
                   "grad_w_rel_err": _rel(gw, ref[2])}
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            row["ms"] = _ms(lambda fn=fn: _run(fn, h, w, t), cuda)
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        except Exception as exc:  # noqa: BLE001 - one library's failure is a finding, not the end
            row = {"eps": eps, "error": repr(exc)[:500]}
        rows[name] = row
        log.info("%s: %s", name, json.dumps(row))
    return {"shape": {"tokens": n, "d_model": d, "vocab": v}, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}


def main(argv: list[str] | None = None) -> int:
    """Parse, run, write the JSON."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, 256 tokens, 500 classes: checks this script")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_steps/losses.py times CUDA kernels and this machine has no CUDA device; run "
                         "it on a GPU, or pass --dry-run to check the script on the CPU")
    result = run(256, 32, 500, "cpu") if args.dry_run else run(25000, 512, 37000, "cuda")
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
