"""The MLflow parent run of one pipeline run (the Prefect flow opens it; stage runs become its children).

Its name says which run it is at a glance (``demo 291a2df 2026-11-25 18:40``); it carries the flattened
params, ``params.yaml`` and ``dvc.lock`` as artifacts, and the headline metrics the flow logs at the end
(:func:`flows.report.headline_metrics`), so that MLflow's Compare view has columns to compare. Built on
:mod:`pipeline.core.tracking`, which alone imports ``mlflow``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.core import owner, tracking

log = logging.getLogger(__name__)


def run_name(profile: str, commit: str, when: float | None = None) -> str:
    """``<profile> <short commit> <YYYY-MM-DD HH:MM>`` (local time; ``no-git`` outside a checkout)."""
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(time.time() if when is None else when))
    return f"{profile} {commit[:7] or 'no-git'} {stamp}"


@contextlib.contextmanager
def pipeline_run(name: str, *, params: dict[str, Any], root: str | Path = ".",
                 tags: dict[str, str] | None = None, reopen: str | None = None) -> Iterator[tracking.StageRun]:
    """Open the parent run of one pipeline run; stage runs find it via ``MLFLOW_PARENT_RUN_ID``.

    Logs the flattened params once and ``params.yaml`` as an artifact. The caller exports
    ``MLFLOW_PARENT_RUN_ID`` only to the child processes it starts (never globally). ``tags``
    override the default git tags (:func:`pipeline.core.tracking.git_tags` of ``root``); the run also
    names this process as its owner (:mod:`pipeline.core.owner`), so that a later run can end it if
    this process is killed. ``reopen``: continue that run (a resumed sweep variant, the same params)
    instead of creating one; a run that cannot be reopened is replaced by a new one.
    """
    if not tracking.enabled():
        yield tracking.StageRun()
        return
    root = Path(root)
    client = tracking.mlflow_client(root)
    all_tags = {"mlflow.runName": name, "pipeline": "true", **tracking.git_tags(root), **(tags or {}),
                **owner.owner_tags(root)}
    run_id = _reopen(client, reopen, all_tags) if reopen else None
    if run_id is None:
        run_id = client.create_run(tracking.experiment_id(client, root), tags=all_tags, run_name=name).info.run_id
    handle = tracking.StageRun(client, run_id)
    handle.log_params(params)
    if (root / "params.yaml").is_file():
        handle.log_artifact(root / "params.yaml")
    status = "FAILED"
    try:
        yield handle
        status = "FINISHED"
    finally:
        if (root / "dvc.lock").is_file():
            try:
                handle.log_artifact(root / "dvc.lock")
            except Exception as exc:  # noqa: BLE001
                log.warning("could not log dvc.lock: %s", exc)
        client.set_terminated(run_id, status=status)


def _reopen(client: Any, run_id: str, tags: dict[str, str]) -> str | None:
    """Set ``run_id`` RUNNING again with ``tags``; None when the store has no such run."""
    try:
        client.update_run(run_id, status="RUNNING")
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
    except Exception as exc:  # noqa: BLE001 - e.g. deleted, or another tracking store since
        log.warning("could not reopen MLflow run %s (%s): opening a new one", run_id, exc)
        return None
    return run_id


def child_run(parent_id: str | None, tag: str, value: str, root: str | Path = ".") -> str | None:
    """The newest child run of ``parent_id`` whose tag ``tag`` is ``value`` (e.g. a sweep variant an
    interrupted sweep opened), or None (also when tracking is off)."""
    if not (tracking.enabled() and parent_id):
        return None
    client = tracking.mlflow_client(root)
    experiment = client.get_run(parent_id).info.experiment_id
    quoted = value.replace("'", "\\'")
    runs = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent_id}' and "
                                                          f"tags.`{tag}` = '{quoted}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def end_orphans(root: str | Path = ".", logger: logging.Logger | logging.LoggerAdapter | None = None) -> None:
    """End the MLflow runs a killed flow, sweep or stage of ``root`` left RUNNING (:func:`tracking.end_orphaned_runs`).

    Call it when a pipeline run or sweep starts, holding its lock. A store that cannot be searched is a warning:
    the bookkeeping of earlier runs never stops this one (an unreachable server fails it when its run opens).
    """
    try:
        tracking.end_orphaned_runs(root, logger)
    except Exception as exc:  # noqa: BLE001
        (logger or log).warning("could not end the MLflow runs a killed run left RUNNING: %s", exc)


def tag_run(run_id: str, tags: dict[str, str], root: str | Path = ".") -> None:
    """Set tags on an existing run (e.g. a stage's dvc.lock md5 once DVC has written it)."""
    if tracking.enabled() and run_id:
        client = tracking.mlflow_client(root)
        for k, v in tags.items():
            client.set_tag(run_id, k, str(v))


def ui_page(run_id: str, root: str | Path = ".", port: int = 5000) -> str | None:
    """The page of ``run_id``'s experiment in a local ``mlflow ui``, on its training runs.

    MLflow 3.17's UI opens every experiment on its GenAI overview unless the page's URL (``workflowType``) or the
    top-left "GenAI | Model training" switch says otherwise; the experiment's ``mlflow.experimentKind`` tag is
    consulted only when that switch is hidden. None when the run cannot be read.
    """
    try:
        experiment = tracking.mlflow_client(root).get_run(run_id).info.experiment_id
    except Exception as exc:  # noqa: BLE001 - a link in a report must not fail the pipeline
        log.warning("could not read the experiment of run %s: %s", run_id, exc)
        return None
    return f"http://127.0.0.1:{port}/#/experiments/{experiment}?workflowType=machine_learning"
