"""What dvc.yaml runs for ``train``: ``torchrun ... -m pipeline.train`` with the process count from env.

Hardware is environment, not params, so moving between machines never invalidates the stage:

Single node (default):
    NMT_NPROC        processes on this node (default: the number of CUDA GPUs, else 1)
    -> torchrun --standalone --nproc_per_node=N -m pipeline.train [args]

Fault tolerance (every mode):
    NMT_MAX_RESTARTS  how often torchrun restarts the whole worker group after a rank fails (a crash,
                      a collective timeout, see NMT_DIST_TIMEOUT_S); each restart resumes from the
                      newest complete checkpoint. Default 3 on GPU jobs (CUDA available and
                      NMT_DEVICE not ``cpu``), else 0; ``--max-restarts`` is passed only when > 0.
                      A deterministic failure (bad config or data) is retried too, so keep it small.

Several nodes (run the same command on every node, e.g. from a Slurm or Kubernetes job):
    NMT_NNODES       number of nodes (> 1 switches to multi-node mode)
    NMT_NODE_RANK    this node's rank, 0 .. NMT_NNODES-1 (static rendezvous), or leave it unset and set
    NMT_RDZV_ENDPOINT  host:port of the c10d rendezvous (e.g. node 0:29400) for dynamic rendezvous
    NMT_MASTER_ADDR / NMT_MASTER_PORT  with NMT_NODE_RANK: node 0's address and a free port (29500)
    NMT_RDZV_ID      job id shared by the nodes (default ``nmt-train``)
    -> torchrun --nnodes=M --nproc_per_node=N (--node_rank/--master_addr | --rdzv_*) -m pipeline.train

Every node must see the same repository, params.yaml, shards and ``paths.train`` (a shared file
system): rank 0 writes the checkpoints and every rank reads the newest one on resume.
``python -m pipeline.launch --dry-run`` prints the command instead of running it.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys

from pipeline.errors import ConfigError, PipelineError
from pipeline.stage import setup_logging

log = logging.getLogger(__name__)


def _env_int(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(f"environment {name}", [f"{name}={raw!r}: expected an integer >= {minimum}"])
    return value


def default_nproc() -> int:
    """Number of CUDA GPUs on this node, else 1."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def default_max_restarts() -> int:
    """3 on GPU jobs (transient hardware and network faults are common there), else 0."""
    if os.environ.get("NMT_DEVICE", "").strip() == "cpu":
        return 0
    import torch

    return 3 if torch.cuda.is_available() else 0


def torchrun_command(train_args: list[str]) -> list[str]:
    """The full torchrun command line for this node, from the ``NMT_*`` environment.

    Raises:
        ConfigError: a malformed ``NMT_*`` variable (named, with what is expected).
    """
    nproc = _env_int("NMT_NPROC", 0) or default_nproc()
    nnodes = _env_int("NMT_NNODES", 1)
    cmd = [sys.executable, "-m", "torch.distributed.run"]  # == torchrun, from this interpreter
    if nnodes == 1:
        cmd += ["--standalone", "--nnodes=1", f"--nproc_per_node={nproc}"]
    elif os.environ.get("NMT_RDZV_ENDPOINT"):
        cmd += [f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={os.environ['NMT_RDZV_ENDPOINT']}",
                f"--rdzv_id={os.environ.get('NMT_RDZV_ID', 'nmt-train')}"]
    else:
        if "NMT_NODE_RANK" not in os.environ or "NMT_MASTER_ADDR" not in os.environ:
            raise ConfigError("environment", [
                (f"NMT_NNODES={nnodes} needs either NMT_RDZV_ENDPOINT (host:port, dynamic rendezvous) or "
                 "NMT_NODE_RANK and NMT_MASTER_ADDR (static rendezvous)")])
        node_rank = _env_int("NMT_NODE_RANK", 0, minimum=0)
        if node_rank >= nnodes:
            raise ConfigError("environment", [f"NMT_NODE_RANK={node_rank} must be < NMT_NNODES={nnodes}"])
        cmd += [f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", f"--node_rank={node_rank}",
                f"--master_addr={os.environ['NMT_MASTER_ADDR']}",
                f"--master_port={_env_int('NMT_MASTER_PORT', 29500)}"]
    restarts = _env_int("NMT_MAX_RESTARTS", -1, minimum=0)
    restarts = default_max_restarts() if restarts < 0 else restarts
    if restarts:
        cmd.append(f"--max-restarts={restarts}")
    return cmd + ["-m", "pipeline.train", *train_args]


def main(argv: list[str] | None = None) -> int:
    """Replace this process with torchrun (arguments after ``--dry-run`` filtering go to pipeline.train)."""
    setup_logging()
    args = list(sys.argv[1:] if argv is None else argv)
    dry = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    try:
        cmd = torchrun_command(args)
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
