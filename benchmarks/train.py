"""Benchmark one training step (forward, loss, backward, Adam): our Transformer vs ``torch.nn.Transformer`` of the
same dimensions on the same batches, alternating repeats (A B, B A, ...) so that drift hits both; medians.

Usage: ``python benchmarks/train.py`` (CPU, small config); ``--device cuda --config news-25k --compile step``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model.layers  # noqa: E402
from benchmarks.common import REPO, header, md_table, setup_logging, write_json  # noqa: E402
from model import Transformer, TransformerConfig, label_smoothed_nll_loss, label_smoothed_nll_loss_lean  # noqa: E402
from pipeline.core.env import DEFAULT_MAX_TOKENS  # noqa: E402

BASE = {"d_model": 512, "n_heads": 8, "d_ff": 2048, "n_layers": 6, "vocab_size": 37000}  # the paper's base model
CONFIGS = {  # dims, vocabulary, and the batch: sentences x max length (lengths vary in [max/2, max])
    "small": {"d_model": 256, "n_heads": 4, "d_ff": 1024, "n_layers": 3, "vocab_size": 8000, "batch": 48,
              "max_len": 32},
    "base": {**BASE, "batch": 256, "max_len": 32},
    "base-25k": {**BASE, "batch": 768, "max_len": 44},  # the paper's ~25k target tokens a step, one padded batch
    "news-25k": {**BASE, "tokens_per_step": 25000, "steps": 10},  # the train stage's steps: make_news_steps
    "toy": {"d_model": 32, "n_heads": 2, "d_ff": 64, "n_layers": 1, "vocab_size": 300, "batch": 8, "max_len": 12},
}
NEWS_LENGTHS = REPO / "tests" / "data" / "news_lengths.json"
EPS = 0.1
PAD, BOS, EOS = 0, 2, 3
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (src [B,S], tgt_in [B,T], tgt_out [B,T]) int64
Step = tuple[list[Batch], int]  # one optimizer step: its forward passes and its non-pad target tokens
log = logging.getLogger("benchmarks.train")


class TorchBaseline(nn.Module):
    """``nn.Transformer`` + tied scaled embeddings, sinusoidal positions and the output projection."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=PAD)
        self.register_buffer("positions", model.layers.sinusoid_table(cfg.max_positions, cfg.d_model), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.core = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.n_layers, cfg.d_ff, cfg.dropout,
                                   batch_first=True, norm_first=cfg.pre_norm)

    def _emb(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.embed(x) * math.sqrt(self.cfg.d_model) + self.positions[: x.shape[1]])

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """src [B,S], tgt_in [B,T] -> logits [B,T,V]."""
        t = tgt_in.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=src.device, dtype=torch.bool)
        h = self.core(self._emb(src), self._emb(tgt_in), tgt_mask=causal, src_key_padding_mask=src.eq(PAD),
                      tgt_key_padding_mask=tgt_in.eq(PAD), memory_key_padding_mask=src.eq(PAD), tgt_is_causal=True)
        return F.linear(h, self.embed.weight)


def make_batch(spec: dict, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(src, tgt_in, tgt_out) with lengths in [max_len/2, max_len], padded."""
    g = torch.Generator().manual_seed(seed)
    b, m = spec["batch"], spec["max_len"]
    batch = tuple(torch.full((b, m), PAD) for _ in range(3))
    for i in range(b):
        _fill(batch, i, *(int(torch.randint(m // 2, m, (1,), generator=g)) for _ in range(2)), spec["vocab_size"], g)
    return tuple(t.to(device) for t in batch)


def _fill(batch: tuple[torch.Tensor, ...], i: int, ls: int, lt: int, vocab: int, g: torch.Generator) -> None:
    """Row ``i`` of (src, tgt_in, tgt_out): ``ls`` source and ``lt`` target ids, EOS, BOS before the target."""
    src, tgt_in, tgt_out = batch
    src[i, :ls], src[i, ls] = torch.randint(4, vocab, (ls,), generator=g), EOS
    body = torch.randint(4, vocab, (lt,), generator=g)
    tgt_in[i, 0], tgt_in[i, 1:lt + 1] = BOS, body
    tgt_out[i, :lt], tgt_out[i, lt] = body, EOS


def make_news_steps(spec: dict, device: torch.device, max_tokens: int, seed: int = 0) -> list[Step]:
    """``spec["steps"]`` evenly spaced optimizer steps of the plan :mod:`pipeline.data.batching` makes from the news
    sets' length histogram (:data:`NEWS_LENGTHS`), short to long; token ids are random."""
    import numpy as np

    from pipeline.data.batching import forward_passes, plan_global_batches, token_lengths

    hist = json.loads(NEWS_LENGTHS.read_text(encoding="utf-8"))["histogram"]
    src_len = np.repeat([h[0] for h in hist], [h[2] for h in hist])
    tgt_len = np.repeat([h[1] for h in hist], [h[2] for h in hist])
    plan = plan_global_batches(np.arange(len(src_len)), token_lengths(src_len, tgt_len), tgt_len + 1,
                               tokens_per_step=spec["tokens_per_step"], seed=seed)
    g = torch.Generator().manual_seed(seed)
    steps = []
    for k in np.linspace(0, len(plan) - 1, spec["steps"]).round().astype(int):
        passes = []
        for ids in forward_passes(plan[k], rank=0, world_size=1, max_tokens=max_tokens):
            pairs = [(int(src_len[i]), int(tgt_len[i])) for i in ids]
            passes.append(_pad_pairs(pairs, spec["vocab_size"], g, device))
        steps.append((passes, int(sum(int(tgt_len[i]) + 1 for i in plan[k].ids))))
    return steps


def _pad_pairs(pairs: list[tuple[int, int]], vocab: int, g: torch.Generator, device: torch.device) -> Batch:
    """(src, tgt_in, tgt_out) of random ids with the given (source, target) lengths, padded to the longest."""
    s, t = max(a for a, _ in pairs) + 1, max(b for _, b in pairs) + 1
    batch = (torch.full((len(pairs), s), PAD), torch.full((len(pairs), t), PAD), torch.full((len(pairs), t), PAD))
    for i, (ls, lt) in enumerate(pairs):
        _fill(batch, i, ls, lt, vocab, g)
    return tuple(t.to(device) for t in batch)


def _ours_loss(model, src, tgt_in, tgt_out, loss=label_smoothed_nll_loss):
    return loss(model(src, tgt_in), tgt_out, epsilon=EPS, ignore_index=PAD)[0]


def _torch_loss(model, src, tgt_in, tgt_out):
    logits = model(src, tgt_in)
    return F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(), ignore_index=PAD, reduction="sum",
                           label_smoothing=EPS)


def compiled_loss(mode: str, dynamic: bool, lean: bool = False):
    """Our model's forward and loss as one function, under ``torch.compile`` when ``mode`` is ``step``."""
    ours = functools.partial(_ours_loss, loss=label_smoothed_nll_loss_lean) if lean else _ours_loss
    return torch.compile(ours, dynamic=dynamic) if mode == "step" else ours


def make_step(model: nn.Module, loss_fn, steps: list[Step], device: torch.device):
    """A closure running the next of ``steps`` in turn: each forward pass's loss and backward, then Adam."""
    cuda = device.type == "cuda"
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=cuda or None)
    turn = itertools.cycle(steps)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext

    def step() -> None:
        passes, n_tok = next(turn)
        for batch in passes:
            with autocast():
                loss = loss_fn(model, *batch)
            (loss / n_tok).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
    return step


def measure(steps: dict, iters: int, repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per step for each model, ``repeats`` times in alternating order, after ``warmup`` untimed steps."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for name in names:  # warm up (compiling, allocator, kernels, first-touch)
        t0 = time.perf_counter()
        for _ in range(warmup):
            steps[name]()
        log.info("warm-up %s: %d steps in %.1f s", name, warmup, time.perf_counter() - t0)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            for _ in range(iters):
                steps[name]()
            times[name].append((time.perf_counter() - t0) / iters)
            log.info("repeat %d/%d %s: %.1f ms per step", r + 1, repeats, name, times[name][-1] * 1e3)
    return times


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--config", default=None, choices=sorted(CONFIGS), help="default: small on CPU, base on CUDA")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--iters", type=int, default=3, help="steps per timed repeat")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "train.json")
    p.add_argument("--compile", default="none", choices=["none", "step"],
                   help="torch.compile our model and loss as one function (default: %(default)s)")
    p.add_argument("--loss", default="plain", choices=["plain", "lean"], help="our loss: the log-softmax one, or "
                   "the lean one (no [N, V] fp32 tensor kept)")
    p.add_argument("--causal-flash", action="store_true", help="flash for the decoder's causal self-attention")
    p.add_argument("--dynamic", action="store_true", help="compile for any shape (torch.compile dynamic=True)")
    p.add_argument("--max-tokens", type=int, help="news-25k: padded tokens per forward pass (default: the train "
                   "stage's NMT_MAX_TOKENS default for the device)")
    return p


def _planned(name: str, device: torch.device, args: argparse.Namespace) -> tuple[list[Step], str]:
    """The optimizer steps config ``name`` times and their shape in words."""
    spec = CONFIGS[name]
    if "steps" in spec:
        planned = make_news_steps(spec, device, args.max_tokens or DEFAULT_MAX_TOKENS[device.type])
        passes = sum(len(p) for p, _ in planned) / len(planned)
        shape = f"{len(planned)} planned steps of {passes:.1f} forward passes on average"
    else:
        batch = make_batch(spec, device)
        planned, shape = [([batch], int(batch[2].ne(PAD).sum()))], f"batch {spec['batch']}x{spec['max_len']}"
    if args.iters % len(planned):
        raise SystemExit(f"--iters {args.iters}: config {name} has {len(planned)} steps; use a multiple of it")
    return planned, shape


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.causal_flash:  # the choice before model.layers.CAUSAL_ATTENTION, for an A/B in the same session
        model.layers.CAUSAL_ATTENTION = model.layers.CUDA_ATTENTION
    setup_logging()
    name = args.config or ("base" if args.device == "cuda" else "small")
    spec = CONFIGS[name]
    torch.set_num_threads(args.threads)
    with contextlib.suppress(RuntimeError):  # refused once this process ran inter-op work (e.g. under pytest)
        torch.set_num_interop_threads(1)
    device = torch.device(args.device)
    cfg = TransformerConfig(**{k: spec[k] for k in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers")},
                            max_positions=256)
    planned, shape = _planned(name, device, args)
    torch.manual_seed(0)
    ours, base = Transformer(cfg).to(device).train(), TorchBaseline(cfg).to(device).train()
    loss_fn = compiled_loss(args.compile, args.dynamic, args.loss == "lean")
    steps = {"ours": make_step(ours, loss_fn, planned, device),
             "nn.Transformer": make_step(base, _torch_loss, planned, device)}
    times = measure(steps, args.iters, args.repeats, warmup=max(2, len(planned)))
    n_tok = sum(n for _, n in planned) / len(planned)  # per step, mean over the planned steps
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["nn.Transformer"] / med["ours"]
    paired = statistics.median(b / a for a, b in zip(times["ours"], times["nn.Transformer"]))
    print(md_table(("model", "parameters", "step ms (median)", "target tok/s (median)"),
                   [(k, f"{sum(p.numel() for p in m.parameters()):,}", f"{med[k] * 1e3:.1f}", f"{n_tok / med[k]:,.0f}")
                    for k, m in (("ours", ours), ("nn.Transformer", base))]))
    print(f"\nratio ours / nn.Transformer (tokens/s): **{ratio:.3f}** (config {name}, {args.device}, {args.threads} "
          f"threads, {shape}, {n_tok:.0f} target tokens per step, median of {args.repeats} alternating repeats x "
          f"{args.iters} steps; median of per-repeat ratios {paired:.3f})")
    write_json(args.out, {
        **header(argv if argv is not None else sys.argv[1:]), "config": name, "spec": spec, "device": args.device,
        "threads": args.threads, "target_tokens": n_tok, "repeats": args.repeats, "iters": args.iters,
        "seconds_per_step": times, "median_seconds_per_step": med,
        "tgt_tokens_per_s": {k: n_tok / v for k, v in med.items()}, "ratio": ratio, "paired_ratio_median": paired,
        "compiled": args.compile, "dynamic": args.dynamic, "loss": args.loss, "causal_flash": args.causal_flash,
        "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
