"""What dvc.yaml runs for ``train``: ``torchrun ... -m pipeline.train`` with the process count, nodes and
rendezvous from the ``NMT_*`` environment (:mod:`pipeline.training.torchrun` builds the command line).

The command runs torchrun (:mod:`torch.distributed.run`) inside ``python -m pipeline.launch
--torchrun``, which first makes torchrun's store servers listen on their host address only (torch
binds them to every interface whatever host it is given) and records the agent's pid for the ranks
(``PIPELINE_AGENT_PID``): a rank arms ``PR_SET_PDEATHSIG`` before its slow imports and exits at once
if the agent died before that (:mod:`pipeline.train`), so a killed job leaves no rank behind. A node
whose agent dies makes the others restart their group (NMT_MAX_RESTARTS) and wait for it at the
rendezvous; torchrun does not restart the dead agent, the scheduler starts the node's launcher again
(docs/cluster.md, section 5).

Every node must see the same repository, params.yaml, shards and ``paths.train`` (a shared file
system): rank 0 writes the checkpoints and every rank reads the newest one on resume.
``python -m pipeline.launch --dry-run`` prints the command instead of running it.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys

from pipeline.core import env
from pipeline.core.config import load_params
from pipeline.core.errors import PipelineError
from pipeline.core.stage import setup_logging, stage_parser
from pipeline.training.torchrun import AGENT_FLAG, torchrun_command, wait_until_resolvable

log = logging.getLogger(__name__)

#: The agent's pid, handed to its ranks (see :func:`pipeline.train.die_with_agent`).
AGENT_PID_ENV = "PIPELINE_AGENT_PID"


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
    from pipeline.training import agent  # torch only now: --dry-run and errors stay fast

    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]  # the ranks inherit this environment
    try:
        return agent.run_torchrun(torchrun_args)
    except PipelineError as exc:
        print(f"error: stage train: {exc}", file=sys.stderr)
        return 1


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
