"""torchrun's command line for this node, from the ``NMT_*`` environment (docs/configuration.md; docs/cluster.md):
hardware is environment, not params, so moving between machines never invalidates the train stage.
A one-node job listens on 127.0.0.1 only: torchrun's stores are unauthenticated.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import sys
import time

from pipeline.core import env
from pipeline.core.errors import ConfigError

#: ``python -m pipeline.launch --torchrun ARGS`` runs torchrun with ARGS in this process (the agent).
AGENT_FLAG = "--torchrun"
LOOPBACK = "127.0.0.1"
#: torchrun's c10d ``read_timeout`` (its default): a store operation's limit, lowered to NMT_RDZV_TIMEOUT_S.
READ_TIMEOUT_S = 60
#: node 0's port of a static rendezvous when NMT_RDZV_ENDPOINT names none (torchrun's ``--master_port`` default).
STATIC_PORT = 29500


def _gpus() -> int:
    """CUDA devices torch sees (torch is imported only when this is needed)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_command(train_args: list[str]) -> list[str]:
    """The full torchrun command line for this node; ConfigError for a malformed or incomplete ``NMT_*`` setup."""
    s = env.settings()
    nproc, nnodes = s.nproc or max(_gpus(), 1), s.nnodes
    cmd = [sys.executable, "-m", "pipeline.launch", AGENT_FLAG]  # == torchrun, from this interpreter
    if nnodes == 1:  # --standalone, on loopback only
        cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={LOOPBACK}:0", f"--rdzv_id={s.rdzv_id}",
                f"--local_addr={LOOPBACK}", "--nnodes=1", f"--nproc_per_node={nproc}"]
    elif not s.rdzv_endpoint:
        raise ConfigError(env.SOURCE, [
            (f"NMT_NNODES={nnodes} needs NMT_RDZV_ENDPOINT (host:port where the nodes meet; with NMT_NODE_RANK, "
             "node 0's address: a static rendezvous)")])
    elif s.node_rank is None:
        host, _ = rendezvous_address(s.rdzv_endpoint)
        cmd += [f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={s.rdzv_endpoint}", f"--rdzv_id={s.rdzv_id}",
                f"--rdzv_conf=join_timeout={s.rdzv_timeout_s},read_timeout={min(s.rdzv_timeout_s, READ_TIMEOUT_S)}"]
        if is_loopback(host):  # every node on this machine: the stores and the ranks' sockets stay on loopback
            cmd.append(f"--local_addr={LOOPBACK}")
    else:
        if s.node_rank >= nnodes:
            raise ConfigError(env.SOURCE, [f"NMT_NODE_RANK={s.node_rank} must be < NMT_NNODES={nnodes}"])
        host, port = rendezvous_address(s.rdzv_endpoint)
        cmd += [f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", f"--node_rank={s.node_rank}",
                f"--master_addr={host}", f"--master_port={port or STATIC_PORT}",
                f"--rdzv_conf=timeout={s.rdzv_timeout_s}"]
    restarts = s.max_restarts
    if restarts is None:  # transient hardware and network faults are common on GPU jobs
        restarts = 3 if s.device != "cpu" and _gpus() else 0
    if restarts:
        cmd.append(f"--max-restarts={restarts}")
    return cmd + ["-m", "pipeline.train", *train_args]


def rendezvous_address(endpoint: str) -> tuple[str, int | None]:
    """The host and port (None when omitted) of ``NMT_RDZV_ENDPOINT``: ``host``, ``host:port`` or ``[v6]:port``.

    Raises:
        ConfigError: not of that form, or a port outside 1..65535 (0 would pick a different port on each node).
    """
    match = re.fullmatch(r"\[([^\]]+)\](?::([0-9]+))?|([^:\[\]\s]+)(?::([0-9]+))?", endpoint)
    if match is None:
        raise ConfigError(env.SOURCE, [f"NMT_RDZV_ENDPOINT={endpoint!r}: expected host:port of the rendezvous, "
                                       "e.g. node0.internal:29400"])
    host, port = match.group(1) or match.group(3), match.group(2) or match.group(4)
    if port is not None and not 0 < int(port) < 65536:
        why = "picks another free port on each node, so they never meet" if int(port) == 0 else "is out of range"
        raise ConfigError(env.SOURCE, [f"NMT_RDZV_ENDPOINT={endpoint!r}: port {port} {why}; name a fixed free port "
                                       "in 1..65535, e.g. 29400"])
    return host, None if port is None else int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def wait_until_resolvable() -> None:
    """Wait up to ``NMT_RDZV_TIMEOUT_S`` for a multi-node rendezvous host to resolve (ConfigError if not)."""
    s = env.settings()
    value = s.rdzv_endpoint
    if s.nnodes == 1 or not value:
        return
    host = rendezvous_address(value)[0]
    deadline = time.monotonic() + s.rdzv_timeout_s
    while True:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            return
        except (socket.gaierror, UnicodeError) as exc:
            if time.monotonic() >= deadline:
                why = getattr(exc, "strerror", None) or str(exc)
                raise ConfigError(env.SOURCE, [
                    f"NMT_RDZV_ENDPOINT={value!r}: host {host!r} did not resolve within {s.rdzv_timeout_s} s "
                    f"(NMT_RDZV_TIMEOUT_S) [{why}]; name a host every node can resolve (node 0's name or "
                    "address), or raise NMT_RDZV_TIMEOUT_S if its name is published later"]) from None
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
