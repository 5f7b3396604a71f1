"""``train.max_minutes`` as a pause: the run keeps its checkpoints, fails with one line, and resumes when rerun.

A paused run exits 1 so that DVC records nothing; rank 0 leaves a ``PAUSED`` file naming the job so that
torchrun's restarts fail at once instead of training another ``max_minutes`` each.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.core.errors import PipelineError
from pipeline.core.owned import discard, write_text

MARKER = "PAUSED"


class Paused(PipelineError):
    """``train.max_minutes`` ran out before ``max_steps``: checkpoints are kept, rerun to go on."""


def _job() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def check_restart(run_dir: str | Path, *, is_main: bool) -> None:
    """Fail (:class:`Paused`) when this is torchrun's restart of a job that paused; rank 0 clears a stale marker."""
    marker = Path(run_dir) / MARKER
    try:
        job, _, message = marker.read_text(encoding="utf-8").partition("\n")
    except FileNotFoundError:
        return
    if _job() and job == _job():
        raise Paused(message.strip())
    if is_main:
        discard(marker)


def pause(run_dir: str | Path, *, max_minutes: float, step: int, max_steps: int, is_main: bool) -> Paused:
    """The error that ends a paused run; rank 0 leaves the marker for torchrun's restarts."""
    message = (f"train.max_minutes ({max_minutes:g}) reached at step {step} of train.max_steps ({max_steps}): "
               f"checkpoints kept in {run_dir}; run the train stage again (dvc repro) to resume toward max_steps")
    if is_main:
        write_text(Path(run_dir) / MARKER, f"{_job()}\n{message}\n")
    return Paused(message)
