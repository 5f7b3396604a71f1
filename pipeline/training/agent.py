"""torchrun's agent, run in ``python -m pipeline.launch`` (the ranks' side is :mod:`pipeline.training.distributed`).
torchrun's own flags (:mod:`pipeline.training.torchrun`) give the loopback address (``--local_addr``) and the bounded
waits (``--rdzv_conf=join_timeout=..,read_timeout=..``; ``timeout`` when static), and torch's
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` lets a replaced node join a later round. Two changes to torch's agent remain,
each for what no flag gives and each shown failing without it by a test: store servers listen on their host only,
and a rendezvous that hangs in C++ ends within ``NMT_RDZV_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import torch.distributed as dist

from pipeline.core import env
from pipeline.core.errors import PipelineError
from pipeline.training.distributed import listen_on

log = logging.getLogger(__name__)

#: torch's opt-out of the c10d rendezvous sharing its agent's store with the ranks (pytorch/pytorch#125743): each
#: round then publishes a new address for rank 0 to host the ranks' store at, so a node replacing a dead one can
#: join (a shared store's address is set up in the first round only, pytorch/pytorch#135712). Without it,
#: test_multinode.py's killed-node test fails: the new node waits for the round's MASTER_ADDR key.
SHARED_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
#: Seconds past ``NMT_RDZV_TIMEOUT_S`` before :func:`bound_rendezvous` ends a rendezvous torch did not end.
RDZV_GRACE_S = 10


class RendezvousFailed(PipelineError):
    """torchrun's rendezvous did not complete: a node never joined in time, or the store was lost."""


def bind_stores_to_their_host() -> None:
    """Make every ``TCPStore`` server this process starts listen on its ``host_name`` only (not every interface).

    torch's TCPStore server listens on every interface whatever its ``host_name`` (pytorch/pytorch#173909) and
    ``--local_addr`` only names the address torchrun advertises; ``master_listen_fd`` is TCPStore's one way to choose.
    Shown by tests/pipeline/training/test_launch_security.py::test_torchruns_store_servers_listen_on_their_host_only.
    """
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
                bound = listen_on(host_name, port)
                if bound is not None:
                    master_listen_fd, port = bound
            super().__init__(host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant,
                             master_listen_fd, use_libuv)

    dist.TCPStore = HostBoundTCPStore
    for module in (c10d_rendezvous_backend, static_tcp_rendezvous):
        if getattr(module, "TCPStore", None) is base:
            module.TCPStore = HostBoundTCPStore


def _rendezvous_where(s: env.Settings) -> tuple[str, str]:
    """Where this node meets the others, and the variables the other nodes must share (for the messages)."""
    if s.nnodes == 1:
        return "127.0.0.1 (this node's own rendezvous)", "NMT_RDZV_ID"
    if s.node_rank is None:
        return f"{s.rdzv_endpoint} (NMT_RDZV_ENDPOINT)", "NMT_RDZV_ENDPOINT and NMT_RDZV_ID"
    return f"{s.rdzv_endpoint} (NMT_RDZV_ENDPOINT, static)", "NMT_RDZV_ENDPOINT"


def rendezvous_error_message(exc: Exception) -> str:
    """One line for torchrun's ``RendezvousError`` or a store error its agent left raw, naming the endpoint and what
    to do."""
    from torch.distributed.elastic.rendezvous import (RendezvousConnectionError, RendezvousError,
                                                      RendezvousTimeoutError)

    s = env.settings()
    where, same = _rendezvous_where(s)
    raw = not isinstance(exc, RendezvousError)  # a DistError or TimeoutError of a store operation
    if isinstance(exc, RendezvousTimeoutError) or raw and "timed out" in str(exc).lower():
        return (f"rendezvous {s.rdzv_id!r} at {where} timed out after {s.rdzv_timeout_s} s (NMT_RDZV_TIMEOUT_S): "
                f"fewer than NMT_NNODES={s.nnodes} nodes joined; start the missing node(s) with the same "
                f"{same}, or raise NMT_RDZV_TIMEOUT_S")
    inner = exc.__cause__ or exc
    cause = (str(inner).strip().splitlines() or [type(inner).__name__])[0][-200:]
    if "invalid value returned from server" in cause:  # TCPStore's ping got bytes that are no echo of it
        return (f"rendezvous {s.rdzv_id!r} at {where}: what answered there is not a rendezvous store (another "
                f"program on that port?); check {same} on every node [{cause}]")
    if raw or isinstance(exc, RendezvousConnectionError):
        return (f"lost the rendezvous store at {where}: the node hosting it stopped or cannot be reached; start "
                f"every node again (training resumes from the newest checkpoint) [{cause}]")
    return f"rendezvous {s.rdzv_id!r} at {where} failed: {type(exc).__name__}: {cause}"


def _end_hung_agent() -> None:
    """End this agent at once with one line: its main thread is stuck in C++ (:func:`bound_rendezvous`)."""
    s = env.settings()
    where, same = _rendezvous_where(s)
    sys.stderr.write(f"error: stage train: rendezvous {s.rdzv_id!r} at {where} did not complete within "
                     f"{s.rdzv_timeout_s} s (NMT_RDZV_TIMEOUT_S): nothing there answered as a rendezvous store "
                     f"(another program on that port?) or fewer than NMT_NNODES={s.nnodes} nodes joined; check "
                     f"{same} on every node, or raise NMT_RDZV_TIMEOUT_S\n")
    sys.stderr.flush()
    os._exit(1)


@contextlib.contextmanager
def bound_rendezvous(limit_s: float, on_hang: Callable[[], None]) -> Iterator[None]:
    """Make every rendezvous of torchrun's agent in the block end within ``limit_s`` seconds, in every mode.

    ``join_timeout`` and ``read_timeout`` bound the waits torch's Python code sees, but a TCPStore client that
    reached something other than a store waits inside C++ for its ping's echo, which no timeout ends and where no
    Python signal handler runs; so a timer calls ``on_hang`` (which must end the process) unless the rendezvous has
    returned. Shown by test_multinode.py::test_every_rendezvous_wait_ends_within_the_timeout_[http-server].
    """
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

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
        finally:
            timer.cancel()

    SimpleElasticAgent._rendezvous = _rendezvous  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimpleElasticAgent._rendezvous = original  # type: ignore[method-assign]
        for timer in armed:  # torchrun ended before its first rendezvous
            timer.cancel()


def run_torchrun(torchrun_args: list[str]) -> int:
    """Run torchrun's agent in this process with the changes above; 0, or the first failed rank's exit code.

    A rank killed by a signal, or this agent stopped by SIGTERM or SIGINT, gives ``128 + signal``, with one line.
    """
    bind_stores_to_their_host()
    os.environ[SHARED_STORE_OPT_OUT] = "1"
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import main as torchrun

    try:
        with bound_rendezvous(env.settings().rdzv_timeout_s + RDZV_GRACE_S, _end_hung_agent):
            torchrun(torchrun_args)
    except (RendezvousError, dist.DistError, TimeoutError) as exc:  # the last two: a store operation's, left raw
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
