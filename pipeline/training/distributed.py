"""Process groups and collectives. The only module that imports ``torch.distributed``.

Under ``torchrun`` (env ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` set) :func:`init` opens a process
group: NCCL when CUDA is available, gloo on CPU. Without torchrun it returns a single-process
context and every collective here is the identity, so the training code has one path.

Environment:
    NMT_DIST_TIMEOUT_S   collective timeout in seconds (default 1800): a rank that waits longer
                         for its peers (a hung or dead rank) fails with a :class:`CollectiveError`
                         naming this variable instead of hanging forever (gloo and NCCL both honour
                         the process group's timeout); torchrun then stops the job or, with
                         ``NMT_MAX_RESTARTS``, restarts it from the newest checkpoint.
It is parsed and checked with every other ``NMT_*`` variable in :mod:`pipeline.core.env`. The backend
follows the device (``NMT_DEVICE``): NCCL for CUDA tensors, gloo for CPU ones, as torch.distributed's
documentation recommends.

On a single node (torchrun's store at a loopback ``MASTER_ADDR``, as :mod:`pipeline.launch` sets it)
gloo's and NCCL's own sockets are bound to the loopback interface too (``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME=lo`` unless already set), so the job listens on nothing the network reaches.
A rank dies with its torchrun agent: :func:`pipeline.train.die_with_agent` arms that first thing.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.core import env
from pipeline.core.errors import ConfigError, PipelineError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = env.Settings.dist_timeout_s
_BUCKET_BYTES = 32 << 20
#: The rendezvous round the ranks were started in, set by the agent (:func:`fresh_store_every_round`).
ROUND_ENV = "PIPELINE_RDZV_ROUND"
#: Seconds past ``NMT_RDZV_TIMEOUT_S`` before a rendezvous torch did not end by itself is ended
#: (:func:`bound_rendezvous`): torch's own timeout error, a few seconds after the timeout, comes first.
RDZV_GRACE_S = 10


class CollectiveError(PipelineError):
    """A collective failed: a peer rank timed out (hung) or died."""


class RendezvousFailed(PipelineError):
    """torchrun's rendezvous did not complete: a node never joined in time, or the store was lost."""


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
    """The collective timeout from ``NMT_DIST_TIMEOUT_S`` (seconds, > 0).

    Raises:
        ConfigError: a malformed ``NMT_*`` variable (named, with what is expected).
    """
    return env.settings().dist_timeout_s


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
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def check_cuda(local_rank: int = 0) -> None:
    """Refuse, in one line naming the variable, a CUDA run this machine cannot give ``local_rank`` a GPU for.

    Raises:
        ConfigError: ``NMT_DEVICE=cuda`` without a CUDA device torch can see, or more processes than GPUs.
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 1:
        raise ConfigError(env.SOURCE, ["NMT_DEVICE=cuda: this torch build sees no CUDA device "
                                       "(torch.cuda.is_available() is False); set NMT_DEVICE=cpu or unset it"])
    if local_rank >= count:
        raise ConfigError(env.SOURCE, [f"local rank {local_rank} needs cuda:{local_rank}, but this machine has "
                                       f"{count} CUDA device(s); set NMT_NPROC <= {count}"])


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store with keys private to this attempt: its rendezvous round, else its restart count.

    After ``--max-restarts`` brings the workers back, a store that outlived them still holds the
    previous attempt's gloo addresses under the same keys; new ranks then connect to dead ports and fail
    ("Gloo connectFullMesh failed ... Connection refused"). A per-attempt prefix avoids that. The c10d
    rendezvous round (``PIPELINE_RDZV_ROUND``) is the same on every node; ``TORCHELASTIC_RESTART_COUNT``
    counts this node's agent's restarts only, so it differs on a node whose agent was replaced
    (pytorch/pytorch#135712) and is used only by the static rendezvous, where all agents live on.
    """
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get(ROUND_ENV)
    key = f"round-{attempt}" if attempt else f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"nmt/{key}", store)


def bind_to_loopback_if_local() -> None:
    """Bind gloo's and NCCL's sockets to the loopback interface when every peer is on this node.

    That is when torchrun's store (``MASTER_ADDR``) is a loopback address. Otherwise gloo binds the
    address this host's name resolves to, and NCCL the first usable interface, both reachable from
    the network. A variable the user set is kept.
    """
    addr = os.environ.get("MASTER_ADDR", "").strip("[]")
    try:
        local = addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        local = False
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
            text = str(exc)
            rank = dist.get_rank() if dist.is_initialized() else 0
            cause = (text.strip().splitlines() or [type(exc).__name__])[0][-200:]
            resume = ("The job resumes from the newest checkpoint when relaunched (torchrun restarts it by itself "
                      "up to NMT_MAX_RESTARTS times).")
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise CollectiveError(
                    f"rank {rank}: collective {fn.__name__} timed out after {timeout_s():g} s (NMT_DIST_TIMEOUT_S): "
                    f"another rank hung or is far behind; check its log. Raise NMT_DIST_TIMEOUT_S if a step, "
                    f"validation or checkpoint write legitimately takes longer. {resume} [{cause}]") from None
            if any(w in text.lower() for w in ("closed", "reset by peer", "broken pipe")):
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


@_collective
def all_reduce_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum the gradients of ``params`` over ranks, in flat buckets of ~32 MB.

    A parameter without a gradient contributes zeros (its ``.grad`` is created), so every rank
    issues the same collectives even when it had no forward pass in this step.
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


@_collective
def barrier() -> None:
    """Wait for every rank (no-op when alone)."""
    if _active():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group if one was joined (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def bind_stores_to_their_host() -> None:
    """Make every ``TCPStore`` server this process starts listen on its ``host_name`` only.

    torch's TCPStore server binds every interface (``[::]``) whatever host it is given; torchrun's
    rendezvous store and the store it shares with the ranks are unauthenticated key-value servers.
    This hands the server a socket already bound to ``host_name`` (``master_listen_fd``).
    """
    import datetime

    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    base = dist.TCPStore
    if getattr(base, "_nmt_bound", False):
        return

    class HostBoundTCPStore(base):  # type: ignore[misc, valid-type]
        _nmt_bound = True

        def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                     timeout: datetime.timedelta = datetime.timedelta(seconds=300), wait_for_workers: bool = True,
                     multi_tenant: bool = False, master_listen_fd: int | None = None, use_libuv: bool = True) -> None:
            if is_master and master_listen_fd is None:
                bound = _listen_on(host_name, port)
                if bound is not None:
                    master_listen_fd, port = bound
            super().__init__(host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant,
                             master_listen_fd, use_libuv)

    dist.TCPStore = HostBoundTCPStore
    for module in (c10d_rendezvous_backend, static_tcp_rendezvous):
        if getattr(module, "TCPStore", None) is base:
            module.TCPStore = HostBoundTCPStore


def _listen_on(host: str, port: int) -> tuple[int, int] | None:
    """A listening socket bound to ``host:port`` (port 0: a free one): (its fd, its port).

    None when the port is taken (a multi-tenant store of this process already serves it, bound the
    same way; otherwise torch reports the clash itself). An unresolvable host raises RuntimeError.
    """
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


def fresh_store_every_round() -> None:
    """Make torchrun's c10d rendezvous give the ranks a new store each round, and tell them the round.

    ``DynamicRendezvousHandler.next_rendezvous`` (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py)
    starts the store it shares with the ranks, and publishes its address, in its first round only and
    reuses both afterwards. When a node's agent dies and a new one takes its place, the newcomer waits
    for an address the surviving rank-0 agent never publishes again (and a survivor that was not rank 0
    would keep sending its ranks to the dead node's store). Forgetting both before every round makes
    that round's rank-0 agent start a store and publish it, as pytorch/pytorch#135712 chose for retries.
    The round, the same on every node, goes to the ranks in ``PIPELINE_RDZV_ROUND`` (:func:`_attempt_store`).
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    original = DynamicRendezvousHandler.next_rendezvous
    if getattr(original, "_nmt_fresh_store", False):
        return

    def next_rendezvous(self):  # noqa: ANN001, ANN202 - torch's signature
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        info = original(self)
        os.environ[ROUND_ENV] = str(self._state_holder.state.round)  # the ranks inherit the agent's environment
        return info

    next_rendezvous._nmt_fresh_store = True  # type: ignore[attr-defined]
    DynamicRendezvousHandler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]


def _rendezvous_where(s: env.Settings) -> tuple[str, str]:
    """Where this node meets the others, and the variables the other nodes must share (for the messages)."""
    if s.nnodes == 1:
        return "127.0.0.1 (this node's own rendezvous)", "NMT_RDZV_ID"
    if s.node_rank is None:
        return f"{s.rdzv_endpoint} (NMT_RDZV_ENDPOINT)", "NMT_RDZV_ENDPOINT and NMT_RDZV_ID"
    return f"{s.rdzv_endpoint} (NMT_RDZV_ENDPOINT, static)", "NMT_RDZV_ENDPOINT"


def rendezvous_error_message(exc: Exception) -> str:
    """One line for a failed rendezvous (a ``RendezvousError`` of torchrun), naming the endpoint and what to do."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError

    s = env.settings()
    where, same = _rendezvous_where(s)
    if isinstance(exc, RendezvousTimeoutError):
        return (f"rendezvous {s.rdzv_id!r} at {where} timed out after {s.rdzv_timeout_s} s (NMT_RDZV_TIMEOUT_S): "
                f"fewer than NMT_NNODES={s.nnodes} nodes joined; start the missing node(s) with the same "
                f"{same}, or raise NMT_RDZV_TIMEOUT_S")
    inner = exc.__cause__ or exc
    cause = (str(inner).strip().splitlines() or [type(inner).__name__])[0][-200:]
    if isinstance(exc, RendezvousConnectionError):
        return (f"lost the rendezvous store at {where}: the node hosting it stopped or cannot be reached; start "
                f"every node again (training resumes from the newest checkpoint) [{cause}]")
    return f"rendezvous {s.rdzv_id!r} at {where} failed: {type(exc).__name__}: {cause}"


def hung_rendezvous_message() -> str:
    """One line for a rendezvous still waiting after ``NMT_RDZV_TIMEOUT_S`` (:func:`bound_rendezvous`)."""
    s = env.settings()
    where, same = _rendezvous_where(s)
    return (f"rendezvous {s.rdzv_id!r} at {where} did not complete within {s.rdzv_timeout_s} s (NMT_RDZV_TIMEOUT_S): "
            f"nothing there answered as a rendezvous store (another program on that port?) or fewer than "
            f"NMT_NNODES={s.nnodes} nodes joined; check {same} on every node, or raise NMT_RDZV_TIMEOUT_S")


@contextlib.contextmanager
def bound_rendezvous(limit_s: float, on_hang: Callable[[], None]) -> Iterator[None]:
    """Make every rendezvous of torchrun's agent in the block end within ``limit_s`` seconds, in every mode.

    torch gives up by itself where it has a timeout for the wait (``join_timeout`` and ``read_timeout`` of the
    c10d backend, ``timeout`` of the static one, all set from ``NMT_RDZV_TIMEOUT_S`` by :mod:`pipeline.launch`),
    but a store client that reached something other than a store (an HTTP server on the port) waits for its
    answer forever, inside C++, where no Python signal handler runs. So a timer calls ``on_hang`` (which
    must end the process) unless the rendezvous is done by then: the first one counts from this call (torchrun
    connects to the c10d store while it builds the rendezvous handler), each later one (after a restart) from
    its start; each ends when ``SimpleElasticAgent._rendezvous`` (torch/distributed/elastic/agent/server/api.py:
    the rendezvous and the ranks' assignment, before any worker starts) returns. A store error it raises (a
    static rendezvous' ``DistStoreError``/``DistNetworkError``, which torchrun would print as a traceback)
    becomes torchrun's ``RendezvousTimeoutError``/``RendezvousConnectionError``.
    """
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.rendezvous import (RendezvousConnectionError, RendezvousError,
                                                      RendezvousTimeoutError)

    def arm() -> threading.Timer:
        timer = threading.Timer(limit_s, on_hang)
        timer.daemon = True
        timer.start()
        return timer

    armed = [arm()]  # the first rendezvous: from now
    original = SimpleElasticAgent._rendezvous

    def _rendezvous(self, worker_group):  # noqa: ANN001, ANN202 - torch's signature
        timer = armed.pop() if armed else arm()
        try:
            return original(self, worker_group)
        except RendezvousError:
            raise
        except (dist.DistError, TimeoutError) as exc:
            kind = RendezvousTimeoutError if "timed out" in str(exc).lower() else RendezvousConnectionError
            raise kind(str(exc)) from exc
        finally:
            timer.cancel()

    SimpleElasticAgent._rendezvous = _rendezvous  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimpleElasticAgent._rendezvous = original  # type: ignore[method-assign]
        for timer in armed:  # torchrun ended before its first rendezvous
            timer.cancel()


def _end_hung_agent() -> None:
    """End this agent at once with :func:`hung_rendezvous_message` (its main thread is stuck in C++)."""
    sys.stderr.write(f"error: stage train: {hung_rendezvous_message()}\n")
    sys.stderr.flush()
    os._exit(1)


def run_torchrun(torchrun_args: list[str]) -> int:
    """Run torchrun's agent in this process, its store servers bound to their host only.

    A rendezvous still waiting ``RDZV_GRACE_S`` after ``NMT_RDZV_TIMEOUT_S`` ends the process (exit code 1)
    with one line naming the endpoint (:func:`bound_rendezvous`).

    Returns:
        0 when every rank succeeded, else the first failed rank's exit code (``128 + signal`` for a
        rank killed by a signal). Each rank has already printed its own one-line error, so torchrun's
        ``ChildFailedError`` traceback and failure table (dozens of lines that bury it) are replaced by
        one line naming the rank and its exit code. ``128 + signal`` with one line, not torchrun's
        ``SignalException`` traceback, when this agent is stopped by SIGTERM or SIGINT.

    Raises:
        RendezvousFailed: the nodes did not all join within ``NMT_RDZV_TIMEOUT_S`` (at the start or
            after a restart), or the rendezvous store was lost: one line, naming the endpoint.
    """
    bind_stores_to_their_host()
    fresh_store_every_round()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import main as torchrun

    try:
        with bound_rendezvous(env.settings().rdzv_timeout_s + RDZV_GRACE_S, _end_hung_agent):
            torchrun(torchrun_args)
    except RendezvousError as exc:
        raise RendezvousFailed(rendezvous_error_message(exc)) from None
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode < 0:
            log.error("training failed: rank %d was killed by signal %d", rank, -failure.exitcode)
            return 128 - failure.exitcode
        log.error("training failed: rank %d ended with exit code %d (its error is above)", rank, failure.exitcode)
        return failure.exitcode or 1
    except SignalException as exc:  # SIGTERM (how a flow stops its stage) or SIGINT: torchrun stopped the ranks
        log.error("training stopped by %s (its ranks too); run the stage again to resume from the newest complete "
                  "checkpoint", signal.Signals(exc.sigval).name)
        return 128 + int(exc.sigval)
    return 0
