"""Memory: a pre-flight forward+backward on the plan's largest batch shapes, and out-of-memory reports.

Training fails fast, before the first step, when one micro-batch cannot fit: the pre-flight runs
the worst shapes the batch plan can produce (the most padded tokens, and the longest sequences,
whose attention costs the most) with synthetic token ids and turns an out-of-memory error into a
:class:`~pipeline.core.errors.PipelineError` naming ``train.max_tokens`` and the shape. An
out-of-memory error later in the run (fragmentation, a co-tenant) skips that optimizer step on
every rank, as fairseq does, and is counted (``oom_skipped_steps`` in train.json).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence

import numpy as np
import torch

from model import Transformer, autocast, label_smoothed_nll_loss
from pipeline.core.errors import PipelineError
from pipeline.training.hooks import Hooks
from pipeline.training.state import TrainState

log = logging.getLogger(__name__)

MAX_OOM_STREAK = 3
"""Consecutive optimizer steps skipped for lack of memory after which training stops."""


def largest_shapes(batches: Sequence[np.ndarray], ids: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """The plan's worst micro-batch shapes ``(sentences, length)``: most tokens, then most attention.

    Args:
        batches: the frozen plan (arrays of example ids).
        ids: [N] example ids; lengths: [N] cost lengths (``batching.token_lengths``), aligned.

    Returns:
        One or two distinct shapes; ``length`` bounds the source (+EOS) and target (+BOS) sides.
    """
    order = np.argsort(ids, kind="stable")
    sorted_ids, sorted_len = np.asarray(ids)[order], np.asarray(lengths)[order]
    shapes = [(len(b), int(sorted_len[np.searchsorted(sorted_ids, b)].max())) for b in batches if len(b)]
    most_tokens = max(shapes, key=lambda s: (s[0] * s[1], s[1]))
    most_attention = max(shapes, key=lambda s: (s[0] * s[1] * s[1], s[0]))
    return list(dict.fromkeys([most_tokens, most_attention]))


def free_memory(device: torch.device) -> None:
    """Release what a failed step left behind (call outside the ``except`` block)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check(model: Transformer, shapes: Sequence[tuple[int, int]], *, device: torch.device, max_tokens: int,
          label_smoothing: float, rank: int = 0, hooks: Hooks | None = None) -> None:
    """Run one forward+backward per shape; leave the model without gradients.

    ``hooks`` are reached at ``preflight`` before each shape (fault-injection tests).

    Raises:
        PipelineError: out of memory, naming the shape and ``train.max_tokens`` to lower.
    """
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)  # synthetic ids; the global generators are reseeded per micro-batch
    failed = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for n, length in shapes:
        try:
            (hooks or Hooks()).at("preflight", 0, rank)
            tokens = torch.randint(4, cfg.vocab_size, (3, n, length), generator=gen).to(device)
            with autocast(device):
                logits = model(tokens[0], tokens[1])
            loss, _ = label_smoothed_nll_loss(logits, tokens[2], epsilon=label_smoothing, ignore_index=cfg.pad_id)
            loss.backward()
        except torch.OutOfMemoryError as exc:
            failed = (n, length, str(exc).splitlines()[0][:200] if str(exc) else "")
            break
        finally:
            model.zero_grad(set_to_none=True)
    free_memory(device)
    if failed:
        n, length, cause = failed
        raise PipelineError(
            f"pre-flight on {device}: one forward+backward of the largest micro-batch shape of the plan ({n} "
            f"sentences x {length} tokens, train.max_tokens={max_tokens}) ran out of memory. Lower "
            f"train.max_tokens (e.g. to {max(length, max_tokens // 2)}); the accumulation grows so that "
            f"train.tokens_per_step is kept [{cause}]")
    if device.type == "cuda":
        peak, total = torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
        log.info("pre-flight: largest micro-batch shapes %s fit, peak %.2f of %.2f GiB", list(shapes),
                 peak / 2**30, total / 2**30)
    else:
        log.info("pre-flight: largest micro-batch shapes %s fit", list(shapes))


def skip_step(progress: TrainState, oom: str | None, *, rank: int, device: torch.device) -> None:
    """Count an optimizer step that every rank skips because one ran out of memory.

    Args:
        progress: the run's position (``oom_skipped`` and ``oom_streak`` are updated).
        oom: this rank's out-of-memory micro-batch shape, or None when another rank ran out.

    Raises:
        PipelineError: the :data:`MAX_OOM_STREAK`-th consecutive skip, naming ``train.max_tokens``.
    """
    free_memory(device)
    step = progress.step + 1
    progress.oom_skipped += 1
    progress.oom_streak += 1
    where = f"rank {rank}, {oom}" if oom else "another rank"
    log.warning("train step %d: out of memory (%s); the step is skipped on every rank (%d skipped so far; lower "
                "train.max_tokens if this repeats)", step, where, progress.oom_skipped)
    if progress.oom_streak >= MAX_OOM_STREAK:
        raise PipelineError(
            f"train step {step}: {progress.oom_streak} optimizer steps in a row ran out of memory (last: {where}) "
            f"and were skipped; lower train.max_tokens (the accumulation grows so that train.tokens_per_step is "
            f"kept) and move paths.train away (a run resumes only under the train.max_tokens it started with)")
