"""Process groups and collectives of the training ranks (torchrun's agent side is :mod:`pipeline.training.agent`).
Without ``torchrun`` every collective here is the identity, so the training code has one path.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pipeline.core import env
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.training.torchrun import is_loopback

log = logging.getLogger(__name__)



class CollectiveError(PipelineError):
    """A collective failed: a peer rank timed out (hung) or died."""


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: rank, world size and its device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the one process that writes files and logs to MLflow)."""
        return self.rank == 0


def timeout_s() -> float:
    """The collective timeout from ``NMT_DIST_TIMEOUT_S`` (seconds, > 0; a malformed value is a ConfigError)."""
    return env.settings().dist_timeout_s


def _env_int(name: str, default: int) -> int:
    """The integer torchrun set in ``name``, or ``default``; one line naming the variable when malformed."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise PipelineError(f"environment {name}={os.environ[name]!r}: expected an integer (set by torchrun)") from None


def init(device: str | None = None) -> DistContext:
    """Join the process group torchrun prepared (or run alone) on ``device`` ``cuda`` or ``cpu`` (default: CUDA)."""
    world, rank, local_rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda:
        check_cuda(local_rank)
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        bind_to_loopback_if_local()
        backend = "nccl" if use_cuda else "gloo"
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        timeout = datetime.timedelta(seconds=timeout_s())
        dist.init_process_group(backend=backend, store=_attempt_store(timeout), rank=rank, world_size=world,
                                timeout=timeout, **kwargs)
        log.info("rank %d/%d joined the %s process group on %s", rank, world, backend, dev)
    return DistContext(rank=rank, world_size=world, device=dev)


def check_cuda(local_rank: int = 0) -> None:
    """Refuse (ConfigError naming the variable) a CUDA run this machine cannot give ``local_rank`` a GPU for."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 1:
        raise ConfigError(env.SOURCE, ["NMT_DEVICE=cuda: this torch build sees no CUDA device "
                                       "(torch.cuda.is_available() is False); set NMT_DEVICE=cpu or unset it"])
    if local_rank >= count:
        raise ConfigError(env.SOURCE, [f"local rank {local_rank} needs cuda:{local_rank}, but this machine has "
                                       f"{count} CUDA device(s); set NMT_NPROC <= {count}"])


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """The ranks' store for this attempt. Under a c10d rendezvous (``TORCHELASTIC_USE_AGENT_STORE=False``, as
    :mod:`pipeline.training.agent` asks) rank 0 hosts a new one at ``MASTER_ADDR:MASTER_PORT``, listening on that
    address only; a static rendezvous shares its agent's store, whose keys this attempt's restart count makes
    private (after a restart it still holds the previous attempt's gloo addresses: "Gloo connectFullMesh failed").
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        host, port, rank = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), _env_int("RANK", 0)
        bound = listen_on(host, port) if rank == 0 else None
        if rank == 0 and bound is None:
            raise PipelineError(f"MASTER_PORT={port} on {host} was taken before rank 0 could host the ranks' store "
                                "(torchrun picked it free); run the stage again")
        return dist.TCPStore(host, port, _env_int("WORLD_SIZE", 1), rank == 0, timeout,
                             master_listen_fd=bound[0] if bound else None)
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"nmt/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def listen_on(host: str, port: int) -> tuple[int, int] | None:
    """(fd, port) of a socket listening on ``host:port`` (port 0: a free one); None when the port is taken."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:  # torchrun turns a RuntimeError of the store into a rendezvous error
        raise RuntimeError(f"TCPStore host {host!r} does not resolve: {exc}") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        if port:
            return None
        raise
    bound_port = sock.getsockname()[1]
    return sock.detach(), bound_port  # the store owns the fd from here on


def bind_to_loopback_if_local() -> None:
    """Bind gloo's and NCCL's sockets to ``lo`` (unless the user set them) when ``MASTER_ADDR`` is loopback."""
    local = is_loopback(os.environ.get("MASTER_ADDR", "").strip("[]"))
    names = {name for _, name in socket.if_nameindex()} if local and hasattr(socket, "if_nameindex") else set()
    if "lo" in names:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(var, "lo")


def _collective(fn: Callable) -> Callable:
    """Turn a timed-out or broken collective into a :class:`CollectiveError` with the remedy."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistError) as exc:
            text = str(exc).lower()
            rank = dist.get_rank() if dist.is_initialized() else 0
            cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0][-200:]
            resume = ("The job resumes from the newest checkpoint when relaunched (torchrun restarts it by itself "
                      "up to NMT_MAX_RESTARTS times).")
            if "timed out" in text or "timeout" in text:
                raise CollectiveError(
                    f"rank {rank}: collective {fn.__name__} timed out after {timeout_s():g} s (NMT_DIST_TIMEOUT_S): "
                    f"another rank hung or is far behind; check its log. Raise NMT_DIST_TIMEOUT_S if a step, "
                    f"validation or checkpoint write legitimately takes longer. {resume} [{cause}]") from None
            if any(w in text for w in ("closed", "reset by peer", "broken pipe")):
                raise CollectiveError(f"rank {rank}: collective {fn.__name__} failed: a peer rank died; its log "
                                      f"names the cause. {resume} [{cause}]") from None
            raise
    return wrapper


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@_collective
def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (identity when alone); returns it."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


@_collective
def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over ranks in place (identity when alone); returns it."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def data_parallel(module: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """``module`` under ``DistributedDataParallel`` that sums its gradients over the ranks (more than one).

    DDP buckets the gradients and all-reduces each bucket as its backward completes, overlapping communication
    with computation. The step's loss is a sum over the global batch, divided by its global token count after the
    all-reduce, so the hook sums: DDP's default (``default_hooks.allreduce_hook``) divides by the world size
    (https://pytorch.org/docs/stable/ddp_comm_hooks.html). The buffers (sinusoids) are equal on every rank.
    """
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(module, device_ids=ids, forward_sync_buffers=False)
    ddp.register_comm_hook(None, _sum_hook)
    log.info("gradients: DistributedDataParallel over %d ranks, summed in buckets of <= %.0f MB during backward",
             ctx.world_size, ddp.bucket_bytes_cap / 2**20)
    return ddp


def _sum_hook(group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: one bucket of gradients summed over ranks (``allreduce_hook`` without the mean)."""
    work = dist.all_reduce(bucket.buffer(), group=group or dist.group.WORLD, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# register_comm_hook compares the annotations with the classes, not with this module's postponed strings
_sum_hook.__annotations__.update(bucket=dist.GradBucket, group=dist.ProcessGroup | None,
                                 **{"return": torch.futures.Future[torch.Tensor]})


def grad_sync(module: Callable, sync: bool) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync()`` unless ``sync`` (the last pass of a step): gradients accumulate locally until then."""
    if sync or not isinstance(module, DistributedDataParallel):
        return contextlib.nullcontext()
    return module.no_sync()


@_collective
def synced_backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` of a step's last pass: under DDP it all-reduces the gradients (timeouts named)."""
    loss.backward()


@_collective
def barrier() -> None:
    """Wait for every rank (no-op when alone)."""
    if _active():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group if one was joined (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
