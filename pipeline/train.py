"""Stage ``train`` (one worker): ``python -m pipeline.launch`` starts ``torchrun -m pipeline.train``.

Run alone, this module trains in a single process (:func:`pipeline.training.loop.train`); then rank 0 draws
the curves (:mod:`pipeline.training.curves`).
"""

from __future__ import annotations

import os
import sys

AGENT_PID_ENV = "PIPELINE_AGENT_PID"  # == pipeline.launch.AGENT_PID_ENV (not imported: it is slower)
_PR_SET_PDEATHSIG = 1


def die_with_agent() -> None:
    """Have the kernel SIGKILL this rank when its torchrun agent dies (Linux); die now if it already has.

    torchrun starts each rank in its own session, so a SIGKILLed agent would otherwise leave an orphaned
    rank that trains on beside the relaunched job, or hangs on the dead agent's store. Run before the slow
    imports: the agent may die in that window. The agent is ``PIPELINE_AGENT_PID`` (set by
    ``python -m pipeline.launch --torchrun``), else this process's parent now. A no-op without ``prctl``.
    """
    import ctypes
    import signal

    recorded = os.environ.get(AGENT_PID_ENV, "")
    parent = int(recorded) if recorded.isdigit() else os.getppid()
    if parent <= 1:  # reparented to init: the agent is gone
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the agent died before prctl took effect (or this is not its child)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__" and (AGENT_PID_ENV in os.environ or "TORCHELASTIC_RUN_ID" in os.environ):
    die_with_agent()  # a rank under torchrun: first thing, before the imports below

import argparse  # after die_with_agent (E402 is not enabled)
from pathlib import Path

import torch

from pipeline.core import env
from pipeline.core.config import Params, checkpoint_folder
from pipeline.core.details import TrainDetails
from pipeline.tracking.harness import stage_main
from pipeline.training.curves import write_curves
from pipeline.training.loop import train as stage


def _run(params: Params, args: argparse.Namespace) -> TrainDetails:
    if threads := env.settings().threads:
        torch.set_num_threads(threads)
    paths = params.paths
    train_csv = Path(paths.plots) / "train.csv"
    record = stage(params.train, model_cfg=params.model, seed=params.seed, shards_dir=paths.shards,
                   spm_model=Path(paths.bpe) / "spm.model", run_dir=checkpoint_folder(params), plots_path=train_csv,
                   device=env.settings().device)
    if os.environ.get("RANK", "0") in ("", "0"):  # rank 0 wrote train.csv
        write_curves(train_csv)
    return record


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m pipeline.train [--params params.yaml]`` (normally under torchrun via pipeline.launch)."""
    return stage_main("train", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
