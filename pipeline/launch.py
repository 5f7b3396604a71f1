"""What dvc.yaml runs for ``train``: ``torchrun ... -m pipeline.train`` with the process count from env.

Hardware is environment, not params, so moving between machines never invalidates the stage:

Single node (default):
    NMT_NPROC        processes on this node (default: the number of CUDA GPUs, else 1)
    -> torchrun --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:0 --local_addr=127.0.0.1 --nnodes=1
       --nproc_per_node=N -m pipeline.train [args]
    Everything the job listens on is bound to 127.0.0.1: torchrun's rendezvous store, the store the
    ranks share (their MASTER_ADDR) and, through GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=lo
    (:mod:`pipeline.training.distributed`), the ranks' own sockets. These stores are unauthenticated
    key-value servers; ``torchrun --standalone`` would listen on every interface.

Fault tolerance (every mode):
    NMT_MAX_RESTARTS  how often torchrun restarts the whole worker group after a rank fails (a crash,
                      a collective timeout, see NMT_DIST_TIMEOUT_S); each restart resumes from the
                      newest complete checkpoint. Default 3 on GPU jobs (CUDA available and
                      NMT_DEVICE not ``cpu``), else 0; ``--max-restarts`` is passed only when > 0.
                      A deterministic failure (bad config or data) is retried too, so keep it small.

Several nodes (run the same command on every node, e.g. from a Slurm or Kubernetes job):
    NMT_NNODES       number of nodes (> 1 switches to multi-node mode)
    NMT_RDZV_ENDPOINT  host:port where the nodes meet (e.g. node 0:29400): a c10d rendezvous, or with
                     NMT_NODE_RANK node 0's address and a free port of it (static rendezvous; port default 29500)
    NMT_NODE_RANK    this node's rank, 0 .. NMT_NNODES-1: a static rendezvous; unset: the c10d one assigns ranks
    NMT_RDZV_ID      job id shared by the nodes of a c10d rendezvous (default ``nmt-train``)
    NMT_RDZV_TIMEOUT_S  how long a node waits at the rendezvous for the others (default 600; torchrun's
                     ``join_timeout`` and ``read_timeout`` (at most 60 s) of c10d, ``timeout`` of the static
                     rendezvous), at the start and after a restart, in every mode: for its host to resolve,
                     for the other nodes, for a store that never answers; then it stops with one line naming
                     the endpoint (:func:`wait_until_resolvable`, :func:`pipeline.training.torchrun.run_torchrun`)
    -> torchrun --nnodes=M --nproc_per_node=N (--rdzv_* | --node_rank/--master_addr/--master_port) -m pipeline.train

A loopback NMT_RDZV_ENDPOINT (127.0.0.1, localhost, ::1) means every node runs on this machine:
``--local_addr=127.0.0.1`` keeps the ranks' store and sockets on loopback too (tests/pipeline/training/
test_multinode.py runs two such nodes). A node whose agent dies makes the others restart their group
(NMT_MAX_RESTARTS) and wait for it at the rendezvous; torchrun does not restart the dead agent, the
scheduler starts the node's launcher again (docs/cluster.md, section 5).

On several nodes each store listens only on the address it is named by: the rendezvous store on the
host of NMT_RDZV_ENDPOINT, the ranks' shared store on the node's own address
(its FQDN, as torchrun hands it to the ranks). So NMT_RDZV_ENDPOINT's host must resolve, on
the node that hosts the store, to the address the other nodes reach it by (not to 127.0.1.1), and
that network should be private to the job: the stores do not authenticate their clients.

The command runs torchrun (:mod:`torch.distributed.run`) inside ``python -m pipeline.launch
--torchrun``, which first makes torchrun's store servers listen on their host address only (torch
binds them to every interface whatever host it is given) and records the agent's pid for the ranks
(``PIPELINE_AGENT_PID``): a rank arms ``PR_SET_PDEATHSIG`` before its slow imports and exits at once
if the agent died before that (:mod:`pipeline.train`), so a killed job leaves no rank behind.

Every node must see the same repository, params.yaml, shards and ``paths.train`` (a shared file
system): rank 0 writes the checkpoints and every rank reads the newest one on resume.
``python -m pipeline.launch --dry-run`` prints the command instead of running it. The variables are
parsed and checked, all at once, in :mod:`pipeline.core.env`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shlex
import socket
import sys
import time

from pipeline.core import env
from pipeline.core.config import load_params
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.core.stage import setup_logging, stage_parser

log = logging.getLogger(__name__)

#: ``python -m pipeline.launch --torchrun ARGS`` runs torchrun with ARGS in this process (the agent).
AGENT_FLAG = "--torchrun"
#: The agent's pid, handed to its ranks (see :func:`pipeline.train.die_with_agent`).
AGENT_PID_ENV = "PIPELINE_AGENT_PID"
LOOPBACK = "127.0.0.1"
#: torchrun's c10d ``read_timeout`` (its default): a store operation's limit, lowered to NMT_RDZV_TIMEOUT_S.
READ_TIMEOUT_S = 60
#: node 0's port of a static rendezvous when NMT_RDZV_ENDPOINT names none (torchrun's ``--master_port`` default).
STATIC_PORT = 29500


def default_nproc() -> int:
    """Number of CUDA GPUs on this node, else 1."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def default_max_restarts() -> int:
    """3 on GPU jobs (transient hardware and network faults are common there), else 0."""
    if env.settings().device == "cpu":
        return 0
    import torch

    return 3 if torch.cuda.is_available() else 0


def torchrun_command(train_args: list[str]) -> list[str]:
    """The full torchrun command line for this node, from the ``NMT_*`` environment (:mod:`pipeline.core.env`).

    Raises:
        ConfigError: a malformed ``NMT_*`` variable (named, with what is expected), or an incomplete
            multi-node setup.
    """
    s = env.settings()
    nproc, nnodes = s.nproc or default_nproc(), s.nnodes
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
        if _is_loopback(host):  # every node on this machine: the stores and the ranks' sockets stay on loopback
            cmd.append(f"--local_addr={LOOPBACK}")
    else:
        if s.node_rank >= nnodes:
            raise ConfigError(env.SOURCE, [f"NMT_NODE_RANK={s.node_rank} must be < NMT_NNODES={nnodes}"])
        host, port = rendezvous_address(s.rdzv_endpoint)
        cmd += [f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", f"--node_rank={s.node_rank}",
                f"--master_addr={host}", f"--master_port={port or STATIC_PORT}",
                f"--rdzv_conf=timeout={s.rdzv_timeout_s}"]
    restarts = default_max_restarts() if s.max_restarts is None else s.max_restarts
    if restarts:
        cmd.append(f"--max-restarts={restarts}")
    return cmd + ["-m", "pipeline.train", *train_args]


def rendezvous_address(endpoint: str) -> tuple[str, int | None]:
    """The host and port (None when omitted) of ``NMT_RDZV_ENDPOINT``: ``host``, ``host:port`` or ``[v6]:port``.

    Without a port torchrun uses 29400 for a c10d rendezvous; a static one uses :data:`STATIC_PORT`.

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


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_agent(torchrun_args: list[str]) -> int:
    """Be torchrun's agent: its store servers on their host only, the agent's pid in the ranks' env.

    A rendezvous that fails (a host that does not resolve, a node that never joins, something else on
    the port) ends it within about ``NMT_RDZV_TIMEOUT_S`` with one line naming the endpoint, not
    torchrun's traceback. The agent's own C++ log lines (each failed connection attempt of a store
    client, with its C++ stack) are silenced unless ``TORCH_CPP_LOG_LEVEL`` is set; the ranks keep theirs.
    """
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    try:
        wait_until_resolvable()
    except PipelineError as exc:
        print(f"error: stage train: {exc}", file=sys.stderr)
        return 1
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # read once, when torch loads
    from pipeline.training import torchrun  # torch only now: --dry-run and errors stay fast

    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]  # the ranks inherit this environment
    try:
        return torchrun.run_torchrun(torchrun_args)
    except PipelineError as exc:
        print(f"error: stage train: {exc}", file=sys.stderr)
        return 1


def wait_until_resolvable() -> None:
    """Wait, up to ``NMT_RDZV_TIMEOUT_S``, for the host of a multi-node rendezvous to resolve.

    A cluster's name service may list a node only once it runs, so a name that does not resolve is
    asked again each second. torch's store client would retry too, for 60 s per attempt, and print a
    C++ stack for each.

    Raises:
        ConfigError: the host still does not resolve: one line naming the variable and the host.
    """
    s = env.settings()
    if s.nnodes == 1:
        return
    value = s.rdzv_endpoint
    if not value:
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


def check_params(train_args: list[str]) -> None:
    """Load the params file ``pipeline.train`` will read, so a bad one is one line before torchrun starts.

    Raises:
        PipelineError: the file is missing or has bad keys (each named, as the stage would name them).
    """
    known, _ = stage_parser("train").parse_known_args(train_args)  # the options pipeline.train parses
    load_params(known.params)


def check_device() -> None:
    """``NMT_DEVICE=cuda`` on a machine whose torch sees no GPU: one line before torchrun starts.

    Raises:
        ConfigError: naming NMT_DEVICE and the remedy.
    """
    if env.settings().device == "cuda":
        from pipeline.training.distributed import check_cuda  # torch only when a GPU is asked for

        check_cuda()


def main(argv: list[str] | None = None) -> int:
    """Replace this process with torchrun (arguments after ``--dry-run`` filtering go to pipeline.train)."""
    args = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    if args[:1] == [AGENT_FLAG]:
        return run_agent(args[1:])
    dry = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    try:
        cmd = torchrun_command(args)
        if not dry:
            check_params(args)
            check_device()
    except PipelineError as exc:
        print(f"error: stage train: {exc}", file=sys.stderr)
        return 1
    if dry:
        print(shlex.join(cmd))
        return 0
    log.info("exec %s", shlex.join(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
