"""The MLflow parent runs the flows open: a pipeline run's (stage runs become its children) and a sweep's.

Tracking never fails a run: what cannot be recorded is a warning. Neither Prefect nor DVC opens MLflow runs,
so this is ours, built on :mod:`pipeline.tracking`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import yaml

from flows.report import headline_from
from flows.sweep_spec import SweepSpec
from flows.sweep_work import SweepState
from pipeline import tracking
from pipeline.core import stages as stage_table
from pipeline.core.details import StageDetails
from pipeline.core.yamlfile import Plain

log = logging.getLogger(__name__)


def run_name(profile: str, commit: str, when: float | None = None) -> str:
    """``<profile> <MM-DD HH:MM> <short commit>`` (local time; ``no-git`` outside a checkout): what tells two runs
    apart first, since MLflow's runs table cuts names at about 20 characters (the year is in its Created column)."""
    stamp = time.strftime("%m-%d %H:%M", time.localtime(time.time() if when is None else when))
    return f"{profile} {stamp} {commit[:7] or 'no-git'}"


@contextlib.contextmanager
def pipeline_run(name: str, *, params: Mapping[str, Plain], root: str | Path = ".",
                 tags: dict[str, str] | None = None, reopen: str | None = None,
                 files: str | Path | None = None) -> Iterator[tracking.StageRun]:
    """The parent run of one pipeline run, with its params; ``tags`` override the git tags of ``root``; ``files``:
    the folder holding the run's params.yaml and (when the block ends) dvc.lock, logged as artifacts (default
    ``root``; a sweep's variant, run in DVC's temporary workspace, has its own)."""
    root = Path(root)
    files = Path(files) if files is not None else root
    with tracking.open_run(name, root=root, tags={"pipeline": "true", **tracking.git_tags(root), **(tags or {})},
                           reopen=reopen) as handle:
        handle.log_params(params)
        if (files / "params.yaml").is_file():
            handle.log_artifact(files / "params.yaml")
        try:
            yield handle
        finally:
            if (files / "dvc.lock").is_file():
                with _never_fails("log dvc.lock"):
                    handle.log_artifact(files / "dvc.lock")


@contextlib.contextmanager
def sweep_run(root: Path, spec: SweepSpec, state: SweepState, flow_run_id: str) -> Iterator[tracking.StageRun]:
    """The MLflow parent run ``sweep-<name>``: created once (its id kept in the state file), reopened on a restart."""
    tags = {**tracking.git_tags(root), "sweep": spec.name, "sweep.parent": "true", "profile": spec.profile,
            "prefect.flow_run_id": flow_run_id}
    earlier = state.data.mlflow_run_id
    with tracking.open_run(spec.run_name, root=root, tags=tags, reopen=earlier) as run:
        if run.run_id and run.run_id != earlier:
            state.data.mlflow_run_id = run.run_id
            state.save()
            run.log_artifact(spec.source, "spec")
        yield run


def end_orphans(root: str | Path = ".", logger: logging.Logger | logging.LoggerAdapter | None = None) -> None:
    """End the MLflow runs a killed flow, sweep or stage of ``root`` left RUNNING; call it holding the run's lock."""
    with _never_fails("end the MLflow runs a killed run left RUNNING", logger):
        tracking.end_orphaned_runs(root, logger)


@contextlib.contextmanager
def _never_fails(what: str, logger: logging.Logger | logging.LoggerAdapter | None = None) -> Iterator[None]:
    """Log an error inside the block as a warning (``could not <what>``): tracking must never fail a run."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001
        (logger or log).warning("could not %s: %s", what, exc)


def record_stage(parent: tracking.StageRun, root: Path, metrics_dir: Path, stage: str) -> None:
    """Tag ``stage``'s MLflow run with its dvc.lock md5, and the parent with ``produced_by.<stage>``."""
    lock = root / "dvc.lock"
    if not (tracking.enabled() and lock.is_file()):
        return
    with _never_fails(f"tag the MLflow run of stage {stage}"):
        details = StageDetails.read(root / metrics_dir, stage)
        if details is not None and (run_id := details.mlflow_run_id):
            md5 = stage_table.lock_md5(yaml.safe_load(lock.read_text(encoding="utf-8")) or {}, stage)
            tracking.tag_run(run_id, {"dvc_lock_md5": md5}, root)
            parent.set_tags({f"produced_by.{stage}": run_id})


def record_end(parent: tracking.StageRun, root: Path, metrics_dir: Path | None, *, succeeded: bool) -> None:
    """Tag the parent with the md5 of ``dvc.lock`` and, after a success, log the headline metrics."""
    if (root / "dvc.lock").is_file():
        with _never_fails("tag the parent run with the dvc.lock md5"):
            parent.set_tags({"dvc_lock_md5": hashlib.md5((root / "dvc.lock").read_bytes()).hexdigest()})  # not security
    if succeeded and metrics_dir is not None:
        with _never_fails("log the headline metrics on the parent run"):
            parent.log_metrics(headline_from(root / metrics_dir))

