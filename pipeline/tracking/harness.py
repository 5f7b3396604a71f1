"""The wrapper every stage runs in (:func:`stage_main`): its MLflow run, its timing, and on rank 0 its records
``<stage>.json`` and ``<stage>.details.json``."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from pipeline.core import env, stages
from pipeline.core.config import Params, flatten, section_dict
from pipeline.core.console import run_cli, stage_parser
from pipeline.core.owned import write_text
from pipeline.core.record import StageDetails
from pipeline.tracking import runs

Details = TypeVar("Details", bound=StageDetails)


def write_metrics(path: str | Path, metrics: Mapping[str, object]) -> None:
    """Write a stage's metrics JSON atomically (sorted keys)."""
    write_text(path, json.dumps(metrics, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def run_stage(name: str, body: Callable[[], Details], *, metrics_dir: str | Path, params: Params | None = None,
              root: str | Path = ".") -> Details:
    """Run one stage's ``body`` with its bookkeeping (MLflow run, params, seconds; on rank 0 ``<stage>.json`` and
    ``<stage>.details.json``, logged with the stage's plots as artifacts) and return its record, with its
    ``seconds`` and ``mlflow_run_id``.

    Raises:
        TypeError: ``body`` returned no :class:`~pipeline.core.record.StageDetails` (a bug in the stage).
    """
    spec = stages.get(name)
    active = os.environ.get("RANK", "0") in ("", "0")
    start = time.monotonic()
    monitor = active and runs.system_metrics_wanted(name, env.settings().device, _cuda_available(name))
    with runs.stage_run(name, root=root, active=active, system_metrics=monitor) as run:
        if params is not None:
            run.queue_params(flatten({s: section_dict(getattr(params, s)) for s in spec.sections}))
        if not spec.lazy_run:
            run.open()  # now, so that the run's duration is the stage's
        record = body()
        if not isinstance(record, StageDetails):
            raise TypeError(f"stage {name} returned a {type(record).__name__}, not its StageDetails record")
        seconds = round(time.monotonic() - start, 3)
        if run.opened:
            run.log_metrics({"stage_seconds": seconds})
        # A stage that logged nothing keeps the run id it reports (register points at an existing model's run).
        details = record.replace(seconds=seconds, mlflow_run_id=run.run_id if run.opened else record.mlflow_run_id)
        if active:
            written = details.to_json()
            if (summary := stages.summary(name, written)) is not None:
                write_metrics(stages.metrics_file(metrics_dir, name), summary)
            write_metrics(stages.details_file(metrics_dir, name), written)
            if run.opened:
                run.log_artifact(stages.details_file(metrics_dir, name))
                for suffix in (".csv", ".png") if params is not None else ():  # the plots the stage wrote
                    if (plot := Path(root) / params.paths.plots / f"{name}{suffix}").is_file():
                        run.log_artifact(plot, "plots")
    return details


def _cuda_available(name: str) -> bool:
    """Whether torch sees CUDA (asked only for the train stage, which imports torch anyway)."""
    if name != "train":
        return False
    import torch

    return torch.cuda.is_available()


def stage_main(name: str, body: Callable[[Params, argparse.Namespace], StageDetails],
               argv: list[str] | None, parser: argparse.ArgumentParser | None = None) -> int:
    """``python -m pipeline.<name>``: :func:`run_cli` around :func:`run_stage` of ``body(params, args)``."""
    def run(params: Params, args: argparse.Namespace) -> None:
        root = Path(getattr(args, "root", "."))
        run_stage(name, lambda: body(params, args), params=params, metrics_dir=root / params.paths.metrics, root=root)

    return run_cli(name, run, argv, parser or stage_parser(stages.get(name).summary))
