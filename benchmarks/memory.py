"""Training memory without a GPU: the peak of live tensor bytes in one optimizer step of a profile's model, counted
on fake tensors (nothing is allocated), at the forward-pass sizes ``NMT_MAX_TOKENS`` allows.

    python benchmarks/memory.py --profile paper-big --max-tokens 8192 32768 65536

Each budget M is one step of two forward+backward passes, M // (encode.max_len + 1) of the longest pairs and
M // 32 pairs of 32 tokens, then Adam: gradients live through the second pass, as in a step of several passes.
bf16 autocast (the CPU's standing in for CUDA's) and the eager loss (``NMT_COMPILE`` off). A count of tensor bytes
in 512-byte blocks: the CUDA context, cuBLAS workspaces and the caching allocator's fragmentation come on top, and
a compiled step's memory is inductor's plan, not counted. On the device the train stage's pre-flight
(pipeline/training/preflight.py) runs the largest real shapes and names ``NMT_MAX_TOKENS`` when they do not fit.
``--calibrate`` counts the eager loss alone on the shape timed on an H100 in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, header, md_table, setup_logging  # noqa: E402
from model import Transformer, TransformerConfig, label_smoothed_nll_loss  # noqa: E402
from pipeline.core.config import params_from_dict  # noqa: E402
from pipeline.core.env import DEFAULT_MAX_TOKENS  # noqa: E402
from pipeline.core.errors import ConfigError, OutputError, PipelineError  # noqa: E402
from pipeline.core.owned import write_text  # noqa: E402
from pipeline.project.profiles import known_profiles, merged_profile  # noqa: E402
from pipeline.training.forward import batch_loss  # noqa: E402

log = logging.getLogger("memory")
BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes
GIB = 2**30


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive (each once, in :data:`BLOCK`-byte blocks) and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage until it is freed (a view or an in-place result is counted once)."""
        storage = tensor.untyped_storage()
        if (key := id(storage)) in self._sizes:
            return
        self._sizes[key] = size = -(-storage.nbytes() // BLOCK) * BLOCK
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self.track(item)
        return out


def _pass(model: Transformer, n: int, length: int, label_smoothing: float) -> None:
    """Forward and backward on random ids [n, length] under bf16 autocast; nothing of it outlives the call."""
    src, tgt_in, tgt_out = (torch.randint(4, model.cfg.vocab_size, (n, length)) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = batch_loss(model, src, tgt_in, tgt_out, label_smoothing)
    loss.backward()


def step_bytes(cfg: TransformerConfig, shapes: Sequence[tuple[int, int]], *, label_smoothing: float,
               fake: bool = True) -> tuple[int, int]:
    """(peak, resident) bytes of an optimizer step over forward passes of ``shapes`` ``(sentences, length)``;
    resident: what stays between steps (weights, buffers, Adam's state). ``fake=False`` allocates for real."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = Transformer(cfg)
        optim = torch.optim.Adam(model.parameters(), lr=1e-4)
        count = LiveBytes()
        for tensor in [*model.parameters(), *model.buffers()]:
            count.track(tensor)
        with count:
            for _ in range(2):  # the second step starts with Adam's moments alive
                for n, length in shapes:
                    _pass(model, n, length, label_smoothing)
                optim.step()
                optim.zero_grad(set_to_none=True)
        return count.peak, count.live


def loss_bytes(tokens: int = 25_000, d_model: int = 512, vocab: int = 37_000) -> int:
    """Peak bytes of the eager label-smoothed loss on bf16 hidden states [tokens, d_model] and output matrix
    [vocab, d_model], forward and backward, 1/8 of the targets padding: RESULTS' H100 loss measurement."""
    with FakeTensorMode(), (count := LiveBytes()):
        hidden = torch.randn(tokens, d_model).bfloat16().requires_grad_()
        out = torch.randn(vocab, d_model).bfloat16().requires_grad_()
        targets = torch.randint(4, vocab, (tokens,))
        targets[-tokens // 8:] = 0
        label_smoothed_nll_loss(hidden @ out.t(), targets, 0.1, 0)[0].backward()
    return count.peak


def check_out(out: Path) -> None:
    """Refuse, before minutes of counting, an ``--out`` that cannot take the JSON file: a folder, a device or FIFO
    (``/dev/full``), or a folder that is not writable (a read-only file system, permissions).

    Raises:
        OutputError: naming ``--out`` and what to do.
    """
    if out.exists() and not out.is_file():
        what = "a folder" if out.is_dir() else "not a regular file (a device or a FIFO)"
        raise OutputError(f"--out {out}: is {what}; name the .json file to write")
    folder = next(p for p in [out.parent.absolute(), *out.parent.absolute().parents] if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):  # os.access sees EROFS too
        raise OutputError(f"--out {out}: {folder} is not a writable folder (read-only file system or "
                          "permissions); name a .json file in a folder you can write")


def main(argv: list[str] | None = None) -> int:
    """Count each budget of ``--max-tokens`` for ``--profile``; the table on stdout, the JSON at ``--out``; a bad
    profile or ``--out`` is one line (exit 1)."""
    setup_logging()
    try:
        return _main(argv)
    except PipelineError as exc:
        log.error("error: %s", exc)
        return 1
    except OSError as exc:  # what check_out cannot foresee (a folder that takes no new file, as /proc)
        log.error("error: --out: %s could not be written (%s); name a .json file in a folder you can write",
                  exc.filename, exc.strerror)
        return 1


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="paper-big",
                   help=f"a profile of profiles/: {known_profiles()} (its model, vocabulary, max_len)")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[DEFAULT_MAX_TOKENS["cuda"], 32768, 65536],
                   help="NMT_MAX_TOKENS values (default: the CUDA default, 32768, 65536)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "memory.json")
    p.add_argument("--calibrate", action="store_true", help="also count the eager loss alone (25,000 x 37,000)")
    args = p.parse_args(argv)
    check_out(args.out)
    try:
        params = params_from_dict(merged_profile(args.profile, REPO), f"profiles/{args.profile}.yaml")
    except ConfigError as exc:
        p.exit(2, f"error: --profile: {exc}\n")
    cfg, longest = params.model.with_vocab(params.bpe.vocab_size), params.encode.max_len + 1
    if min(args.max_tokens) < longest:
        p.error(f"--max-tokens {min(args.max_tokens)} < {longest}: the longest pairs (encode.max_len + 1) need more")
    rows = []
    for budget in args.max_tokens:
        shapes = [(budget // longest, longest), (budget // 32, 32)]
        peak, resident = step_bytes(cfg, shapes, label_smoothing=params.train.label_smoothing)
        rows.append({"max_tokens": budget, "shapes": shapes, "peak_bytes": peak, "resident_bytes": resident})
        log.info("NMT_MAX_TOKENS=%d: peak %.2f GiB", budget, peak / GIB)
    result: dict[str, Any] = {**header(argv if argv is not None else sys.argv[1:]), "profile": args.profile,
                              "torch": torch.__version__, "parameters": cfg.weight_count(), "rows": rows}
    if args.calibrate:
        result["loss_only_peak_bytes"] = loss_bytes()
    write_text(args.out, json.dumps(result, indent=2) + "\n")  # atomic: disk full keeps the previous file
    print(md_table(["NMT_MAX_TOKENS", "passes (sentences x tokens)", "peak GiB", "weights + Adam GiB"],
                   [(r["max_tokens"], ", ".join(f"{n} x {t}" for n, t in r["shapes"]), f"{r['peak_bytes'] / GIB:.2f}",
                     f"{r['resident_bytes'] / GIB:.2f}") for r in rows]))
    if args.calibrate:
        print(f"\neager loss alone, [25,000 x 512] x [37,000 x 512] bf16: peak "
              f"{result['loss_only_peak_bytes'] / GIB:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
