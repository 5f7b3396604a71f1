"""What dvc.yaml runs for ``train``: ``torchrun ... -m pipeline.train`` with the process count, nodes and
rendezvous from the ``NMT_*`` environment (:mod:`pipeline.training.torchrun` builds the command line).

torchrun runs inside ``python -m pipeline.launch --torchrun`` (:mod:`pipeline.training.agent`), which records
its pid for the ranks (``PIPELINE_AGENT_PID``) so that a killed job leaves no rank behind (:mod:`pipeline.train`).
Under ``dvc repro`` the agent also ends (SIGTERM: torchrun stops its ranks) when the dvc process dies, and on one
node it holds a lock beside ``paths.train`` for the whole run, so two trainers never write one folder
(:func:`hold_train_folder`; :mod:`pipeline.training.tether`).
Every node must see the same repository, params.yaml, shards and ``paths.train`` (docs/cluster.md).
Inside a Slurm allocation but outside its steps (``sbatch --wrap "dvc repro"``, ``salloc``'s shell) the stage runs
:data:`SLURM_SCRIPT` instead, which starts this launcher once per node through ``srun``.
``python -m pipeline.launch --dry-run`` prints the command instead of running it.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.core import env
from pipeline.core.config import Params, checkpoint_folder, load_params
from pipeline.core.console import setup_logging, stage_parser
from pipeline.core.errors import PipelineError
from pipeline.core.owned import claim_folder
from pipeline.project.workspace import exclusive_run
from pipeline.training.capacity import check_memory
from pipeline.training.tether import tie_to_dvc
from pipeline.training.torchrun import AGENT_FLAG, torchrun_command, wait_until_resolvable

log = logging.getLogger(__name__)

#: The agent's pid, handed to its ranks (see :func:`pipeline.train.die_with_agent`).
AGENT_PID_ENV = "PIPELINE_AGENT_PID"
#: The job script that runs the train stage on every node of a Slurm allocation (docs/cluster.md).
SLURM_SCRIPT = Path(__file__).resolve().parents[1] / "cluster" / "slurm" / "train.sbatch"
#: The role of a training folder's marker (== pipeline.artifacts.checkpoint.ROLE, not imported: it loads torch).
TRAIN_ROLE = "train"


@contextmanager
def hold_train_folder(folder: str | Path) -> Iterator[Path]:
    """Claim the training folder (``<paths.train>/<digest>``, :func:`pipeline.core.config.checkpoint_folder`) and
    ``paths.train`` above it (pipeline/core/owned.py), and hold the lock ``.<digest>.nmt-train.lock`` beside it for
    the block, on one node (every node of a multi-node job shares ``paths.train``, docs/cluster.md, and node 0 alone
    writes it). The lock lies beside the folder, not in it: the folder holds only checkpoints.

    Raises:
        PipelineError: another training job holds it (its pid named), or the folder is a user's.
    """
    folder = Path(folder)
    if env.settings().nnodes > 1:  # rank 0 claims it once the nodes have met (pipeline/training/setup.py)
        yield folder
        return
    claim_folder(folder.parent, TRAIN_ROLE)
    with exclusive_run(folder.parent, f"training into {folder}", lock=Path(f".{folder.name}.nmt-train.lock"),
                       remedy=f"two trainers must not write one folder ({folder}): wait for it to end or stop it, "
                              "then run the stage again"):
        yield claim_folder(folder, TRAIN_ROLE)


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
    with hold_train_folder(checkpoint_folder(train_params(torchrun_args[torchrun_args.index("pipeline.train") + 1:]))):
        return agent.run_torchrun(torchrun_args)


def train_params(train_args: list[str]) -> Params:
    """The params file ``pipeline.train`` will read, loaded (a bad one is one line before torchrun starts)."""
    known, _ = stage_parser("train").parse_known_args(train_args)  # the options pipeline.train parses
    return load_params(known.params)


def check_params(train_args: list[str]) -> None:
    """Load the params file ``pipeline.train`` will read, so a bad one is one line before torchrun starts; refuse a
    ``paths.train`` folder of the user's (pipeline/core/owned.py) and a model this machine cannot hold."""
    params = train_params(train_args)
    # The agent makes them (hold_train_folder); a multi-node job's rank 0 makes only <paths.train>/<digest>.
    folders = [params.paths.train] if env.settings().nnodes == 1 else []
    for folder in [*folders, checkpoint_folder(params)]:
        claim_folder(folder, TRAIN_ROLE, make=False)
    check_memory(params)


def slurm_command(train_args: list[str]) -> list[str] | None:
    """``bash cluster/slurm/train.sbatch ARGS`` when this runs in a Slurm allocation's batch script or ``salloc``
    shell (``SLURM_JOB_ID`` set, no ``SLURM_STEP_ID``: Slurm sets that in a step only); None elsewhere."""
    if "SLURM_JOB_ID" not in os.environ or "SLURM_STEP_ID" in os.environ:
        return None
    if not SLURM_SCRIPT.is_file():
        raise PipelineError(f"SLURM_JOB_ID={os.environ['SLURM_JOB_ID']}: training in a Slurm allocation runs "
                            f"{SLURM_SCRIPT}, which is missing; restore it from git")
    return ["/bin/bash", str(SLURM_SCRIPT), *train_args]


def main(argv: list[str] | None = None) -> int:
    """Replace this process with torchrun (arguments after ``--dry-run`` filtering go to pipeline.train)."""
    args = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    try:
        if args[:1] == [AGENT_FLAG]:
            return run_agent(args[1:])
        dry = "--dry-run" in args
        args = [a for a in args if a != "--dry-run"]
        cmd = slurm_command(args) or torchrun_command(args)
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
