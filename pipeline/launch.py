"""What dvc.yaml runs for ``train``: ``torchrun ... -m pipeline.train`` with the process count, nodes and
rendezvous from the ``NMT_*`` environment (:mod:`pipeline.training.torchrun` builds the command line).

torchrun runs inside ``python -m pipeline.launch --torchrun`` (:mod:`pipeline.training.agent`), which records
its pid for the ranks (``PIPELINE_AGENT_PID``) so that a killed job leaves no rank behind (:mod:`pipeline.train`).
Every node must see the same repository, params.yaml, shards and ``paths.train`` (docs/cluster.md).
``python -m pipeline.launch --dry-run`` prints the command instead of running it.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path

from pipeline.core import env
from pipeline.core.config import Params, load_params
from pipeline.core.errors import PipelineError
from pipeline.core.owned import claim_folder
from pipeline.core.stage import setup_logging, stage_parser
from pipeline.training.torchrun import AGENT_FLAG, torchrun_command, wait_until_resolvable

log = logging.getLogger(__name__)

TRAIN_ROLE = "train"  # == pipeline.artifacts.checkpoint.ROLE (not imported: it loads torch)
#: Bytes per weight that training keeps whatever the batch: fp32 weights, gradients and Adam's two moments.
TRAIN_BYTES_PER_WEIGHT = 16
#: The agent's pid, handed to its ranks (see :func:`pipeline.train.die_with_agent`).
AGENT_PID_ENV = "PIPELINE_AGENT_PID"


def run_agent(torchrun_args: list[str]) -> int:
    """Be torchrun's agent (:func:`pipeline.training.agent.run_torchrun`), its pid in the ranks' environment.

    The agent's own C++ log lines (each failed connection attempt of a store client, with its C++ stack)
    are silenced unless ``TORCH_CPP_LOG_LEVEL`` is set; the ranks keep theirs.
    """
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    wait_until_resolvable()
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # read once, when torch loads
    from pipeline.training import agent  # torch only now: --dry-run and errors stay fast

    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]  # the ranks inherit this environment
    return agent.run_torchrun(torchrun_args)


def check_params(train_args: list[str]) -> None:
    """Load the params file ``pipeline.train`` will read, so a bad one is one line before torchrun starts; refuse a
    ``paths.train`` folder of the user's (pipeline/core/owned.py) and :func:`check_memory` for its model."""
    known, _ = stage_parser("train").parse_known_args(train_args)  # the options pipeline.train parses
    params = load_params(known.params)
    claim_folder(params.paths.train, TRAIN_ROLE, make=False)  # rank 0 makes it
    check_memory(params)


def _available() -> tuple[int, str] | None:
    """(bytes one training process may use, where they are counted) or None when it cannot be told."""
    s = env.settings()
    if s.device != "cpu":
        import torch  # only here: the CPU path and --dry-run stay light

        if torch.cuda.is_available():
            free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
            return free, "free on the fullest GPU (torch.cuda.mem_get_info), per training process"
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None  # not Linux: the pre-flight and the allocator say it
    procs = s.nproc or 1
    return available // procs, f"of MemAvailable (/proc/meminfo) for each of {procs} training process(es)"


def check_memory(params: Params) -> None:
    """Refuse, naming the model.* keys, a model whose fp32 weights, gradients and Adam's two moments alone
    (:data:`TRAIN_BYTES_PER_WEIGHT` each) exceed what a training process here has; the activations come on top
    (checked by the pre-flight, pipeline/training/preflight.py). Without it a model under ``MAX_WEIGHTS`` that
    this machine cannot hold died allocating, naming no key."""
    if (found := _available()) is None:
        return
    per_process, where = found
    m = params.model
    count = m.weight_count(params.bpe.vocab_size)
    if (need := count * TRAIN_BYTES_PER_WEIGHT) <= per_process:
        return
    raise PipelineError(f"model.d_model {m.d_model}, model.d_ff {m.d_ff}, model.n_layers {m.n_layers} and "
                        f"bpe.vocab_size {params.bpe.vocab_size} make {count:.2e} weights: {need / 2**30:.1f} GiB "
                        f"for fp32 weights, gradients and Adam's moments before any activation, more than the "
                        f"{per_process / 2**30:.1f} GiB {where}; lower model.d_ff or model.d_model")


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
