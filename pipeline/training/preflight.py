"""Memory: a pre-flight forward+backward on the plan's largest batch shapes, and out-of-memory reports.

A later out-of-memory error skips that optimizer step on every rank, as fairseq does, and is counted."""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence

import torch

from model import Transformer, autocast
from pipeline.core.errors import PipelineError
from pipeline.training.forward import BatchLoss, batch_loss
from pipeline.training.faults import Hooks
from pipeline.training.state import TrainState

log = logging.getLogger(__name__)

MAX_OOM_STREAK = 3  # consecutive optimizer steps skipped for lack of memory after which training stops


def largest_shapes(shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The one or two worst ``(sentences, length)`` of this rank's forward passes: most tokens, most attention."""
    most_tokens = max(shapes, key=lambda s: (s[0] * s[1], s[1]))
    most_attention = max(shapes, key=lambda s: (s[0] * s[1] * s[1], s[0]))
    return list(dict.fromkeys([most_tokens, most_attention]))


def _free_memory(device: torch.device) -> None:
    """Release what a failed step left behind (call outside the ``except`` block)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check(model: Transformer, shapes: Sequence[tuple[int, int]], *, device: torch.device, max_tokens: int,
          label_smoothing: float, rank: int = 0, hooks: Hooks | None = None, loss: BatchLoss = batch_loss) -> None:
    """One forward+backward per shape on synthetic ids; out of memory is a PipelineError naming ``NMT_MAX_TOKENS``."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)  # synthetic ids; the global generators are reseeded per forward pass
    failed = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for n, length in shapes:
        try:
            (hooks or Hooks()).at("preflight", 0, rank)
            src, tgt_in, tgt_out = (torch.randint(4, cfg.vocab_size, (n, length), generator=gen).to(device)
                                    for _ in range(3))  # not views of one tensor: a compiled loss would recompile
            with autocast(device):
                loss_sum, _ = loss(model, src, tgt_in, tgt_out, label_smoothing)
            loss_sum.backward()
        except torch.OutOfMemoryError as exc:
            failed = (n, length, str(exc).splitlines()[0][:200] if str(exc) else "")
            break
        finally:
            model.zero_grad(set_to_none=True)
    _free_memory(device)
    if failed:
        n, length, cause = failed
        raise PipelineError(
            f"pre-flight on {device}: one forward+backward of the largest forward-pass shape ({n} sentences x "
            f"{length} tokens, NMT_MAX_TOKENS={max_tokens}) ran out of memory. Set NMT_MAX_TOKENS lower (e.g. "
            f"{max(length, max_tokens // 2)}): each step then takes more forward passes and trains the same "
            f"global batch [{cause}]")
    peak = ""
    if device.type == "cuda":
        peak = (f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} of "
                f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.2f} GiB")
    log.info("pre-flight: largest forward-pass shapes %s fit%s", list(shapes), peak)


def skip_step(progress: TrainState, oom: str | None, *, rank: int, device: torch.device) -> None:
    """Count an optimizer step that every rank skips because one (``oom``: this rank's shape, or None) ran out
    of memory; the :data:`MAX_OOM_STREAK`-th skip in a row is a PipelineError naming ``NMT_MAX_TOKENS``."""
    _free_memory(device)
    step = progress.step + 1
    progress.oom_skipped += 1
    progress.oom_streak += 1
    where = f"rank {rank}, {oom}" if oom else "another rank"
    log.warning("train step %d: out of memory (%s); the step is skipped on every rank (%d skipped so far; lower "
                "NMT_MAX_TOKENS if this repeats)", step, where, progress.oom_skipped)
    if progress.oom_streak >= MAX_OOM_STREAK:
        raise PipelineError(
            f"train step {step}: {progress.oom_streak} optimizer steps in a row ran out of memory (last: {where}) "
            f"and were skipped; set NMT_MAX_TOKENS lower and rerun: the run resumes from its newest checkpoint with "
            f"the same global batches, in more forward passes each")
