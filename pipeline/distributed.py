"""Process groups and collectives. The only module that imports ``torch.distributed``.

Under ``torchrun`` (env ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` set) :func:`init` opens a process
group: NCCL when CUDA is available, gloo on CPU. Without torchrun it returns a single-process
context and every collective here is the identity, so the training code has one path.

Environment:
    NMT_DIST_TIMEOUT_S   collective timeout in seconds (default 1800): a rank that waits longer
                         for its peers fails instead of hanging forever.
    NMT_DIST_BACKEND     force ``gloo`` or ``nccl`` (default: nccl on CUDA, else gloo).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.errors import PipelineError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800.0
_BUCKET_BYTES = 32 << 20


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: rank, world size and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the one process that writes files and logs to MLflow)."""
        return self.rank == 0


def timeout_s() -> float:
    """The collective timeout from ``NMT_DIST_TIMEOUT_S`` (seconds, > 0)."""
    raw = os.environ.get("NMT_DIST_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise PipelineError(f"environment NMT_DIST_TIMEOUT_S={raw!r}: expected a number of seconds > 0")
    return value


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise PipelineError(f"environment {name}={raw!r}: expected an integer (set by torchrun)") from None


def init(device: str | None = None) -> DistContext:
    """Join the process group torchrun prepared (or run alone without it).

    Args:
        device: ``"cuda"`` or ``"cpu"``; default CUDA when available.

    Returns:
        The :class:`DistContext` of this process; on CUDA its device is ``cuda:<LOCAL_RANK>``.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        backend = os.environ.get("NMT_DIST_BACKEND") or ("nccl" if use_cuda else "gloo")
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s()), **kwargs)
        log.info("rank %d/%d joined the %s process group on %s", rank, world, backend, dev)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (identity when alone); returns it."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over ranks in place (identity when alone); returns it."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def all_reduce_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum the gradients of ``params`` over ranks, in flat buckets of ~32 MB.

    A parameter without a gradient contributes zeros (its ``.grad`` is created), so every rank
    issues the same collectives even when it had no micro-batch in this step.
    """
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not _active():
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        bucket.append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
        if size >= _BUCKET_BYTES:
            _reduce_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket)


def _reduce_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def barrier() -> None:
    """Wait for every rank (no-op when alone)."""
    if _active():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group if one was joined (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
