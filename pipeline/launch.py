"""What dvc.yaml runs for ``train``: ``torchrun ... -m pipeline.train`` with the process count, nodes and
rendezvous from the ``NMT_*`` environment (:mod:`pipeline.training.torchrun` builds the command line).

torchrun runs inside ``python -m pipeline.launch --torchrun`` (:mod:`pipeline.training.agent`), which records
its pid for the ranks (``PIPELINE_AGENT_PID``) so that a killed job leaves no rank behind (:mod:`pipeline.train`).
Under ``dvc repro`` the agent also ends (SIGTERM: torchrun stops its ranks) when the dvc process dies, and on one
node it holds ``<paths.train>/.nmt-train.lock`` for the whole run, so two trainers never write one folder.
Every node must see the same repository, params.yaml, shards and ``paths.train`` (docs/cluster.md).
``python -m pipeline.launch --dry-run`` prints the command instead of running it.
"""

from __future__ import annotations

import logging
import os
import select
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.core import env
from pipeline.core.config import Params, load_params
from pipeline.core.errors import PipelineError
from pipeline.core.stage import setup_logging, stage_parser
from pipeline.project.workspace import exclusive_run
from pipeline.training.torchrun import AGENT_FLAG, torchrun_command, wait_until_resolvable

log = logging.getLogger(__name__)

#: The agent's pid, handed to its ranks (see :func:`pipeline.train.die_with_agent`).
AGENT_PID_ENV = "PIPELINE_AGENT_PID"
#: The lock file inside ``paths.train`` that one training job at a time holds (:func:`hold_train_folder`).
TRAIN_LOCK = ".nmt-train.lock"
#: What DVC runs a stage's ``cmd`` through (``$SHELL -c``, dvc/stage/run.py) when the shell does not exec it.
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "fish", "ksh", "mksh"})


def _proc_field(pid: int, name: str) -> str:
    """``comm`` or the parent pid (``ppid``) of ``pid`` from /proc; "" when it is gone."""
    try:
        if name == "comm":
            return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip()
        return Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return ""


def _end_when_gone(pid: int) -> None:
    """Wait for ``pid`` to exit (a pidfd, else polling), then SIGTERM this agent: torchrun stops its ranks."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    except OSError:  # no pidfd (Linux < 5.3): poll
        while _proc_field(pid, "comm"):
            time.sleep(0.5)
        fd = None
    if fd is not None:
        select.select([fd], [], [])
    log.error("stage train: the dvc process (pid %d) that started this training is gone: stopping it", pid)
    os.kill(os.getpid(), signal.SIGTERM)


def tie_to_dvc() -> None:
    """Under ``dvc repro`` (DVC sets ``DVC_STAGE`` for a stage's command), end this agent when the dvc process
    dies: its parent, or the parent of the ``$SHELL -c`` DVC ran the command with. A SIGKILLed dvc signals nobody,
    and the agent and its ranks would train on beside the next run. ``nmt run`` ties the whole stage to the flow
    already (flows/lifeline.py); this covers a bare ``dvc repro``."""
    if "DVC_STAGE" not in os.environ:
        return
    starter = os.getppid()
    if _proc_field(starter, "comm") in _SHELLS:
        starter = int(_proc_field(starter, "ppid") or 1)
    if starter <= 1:
        os.kill(os.getpid(), signal.SIGTERM)  # already orphaned: nothing has started yet
    threading.Thread(target=_end_when_gone, args=(starter,), daemon=True, name="tie-to-dvc").start()


@contextmanager
def hold_train_folder(train_args: list[str]) -> Iterator[None]:
    """Hold ``<paths.train>/.nmt-train.lock`` for the block (one node: every node of a multi-node job shares
    ``paths.train``, docs/cluster.md, and node 0 alone writes it).

    Raises:
        PipelineError: another training job holds it (its pid named).
    """
    if env.settings().nnodes > 1:
        yield
        return
    folder = Path(train_params(train_args).paths.train)
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive_run(folder, f"training into {folder}", lock=Path(TRAIN_LOCK),
                       remedy="two trainers must not write one folder: wait for it to end or stop it, then run the "
                              "stage again"):
        yield


def run_agent(torchrun_args: list[str]) -> int:
    """Be torchrun's agent (:func:`pipeline.training.agent.run_torchrun`), its pid in the ranks' environment.

    The agent's own C++ log lines (each failed connection attempt of a store client, with its C++ stack)
    are silenced unless ``TORCH_CPP_LOG_LEVEL`` is set; the ranks keep theirs.
    """
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    tie_to_dvc()
    wait_until_resolvable()
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # read once, when torch loads
    from pipeline.training import agent  # torch only now: --dry-run and errors stay fast

    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]  # the ranks inherit this environment
    if "pipeline.train" not in torchrun_args:  # torchrun running some other script: no training folder
        return agent.run_torchrun(torchrun_args)
    with hold_train_folder(torchrun_args[torchrun_args.index("pipeline.train") + 1:]):
        return agent.run_torchrun(torchrun_args)


def train_params(train_args: list[str]) -> Params:
    """The params file ``pipeline.train`` will read, loaded (a bad one is one line before torchrun starts)."""
    known, _ = stage_parser("train").parse_known_args(train_args)  # the options pipeline.train parses
    return load_params(known.params)


def check_params(train_args: list[str]) -> None:
    """Load the params file ``pipeline.train`` will read, so a bad one is one line before torchrun starts."""
    train_params(train_args)


def main(argv: list[str] | None = None) -> int:
    """Replace this process with torchrun (arguments after ``--dry-run`` filtering go to pipeline.train)."""
    args = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    try:
        if args[:1] == [AGENT_FLAG]:
            return run_agent(args[1:])
        dry = "--dry-run" in args
        args = [a for a in args if a != "--dry-run"]
        cmd = torchrun_command(args)
        if not dry:
            check_params(args)
            if env.settings().device == "cuda":  # no GPU torch can see: one line before torchrun starts
                from pipeline.training.distributed import check_cuda  # torch only when a GPU is asked for

                check_cuda()
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
