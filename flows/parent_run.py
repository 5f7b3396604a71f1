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

from pipeline.core import tracking

log = logging.getLogger(__name__)


def run_name(profile: str, commit: str, when: float | None = None) -> str:
    """``<profile> <short commit> <YYYY-MM-DD HH:MM>`` (local time; ``no-git`` outside a checkout)."""
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(time.time() if when is None else when))
    return f"{profile} {commit[:7] or 'no-git'} {stamp}"


@contextlib.contextmanager
def pipeline_run(name: str, *, params: dict[str, Any], root: str | Path = ".",
                 tags: dict[str, str] | None = None) -> Iterator[tracking.StageRun]:
    """Open the parent run of one pipeline run; stage runs find it via ``MLFLOW_PARENT_RUN_ID``.

    Logs the flattened params once and ``params.yaml`` as an artifact. The caller exports
    ``MLFLOW_PARENT_RUN_ID`` only to the child processes it starts (never globally). ``tags``
    override the default git tags (:func:`pipeline.core.tracking.git_tags` of ``root``).
    """
    if not tracking.enabled():
        yield tracking.StageRun()
        return
    root = Path(root)
    client = tracking.mlflow_client(root)
    all_tags = {"mlflow.runName": name, "pipeline": "true", **tracking.git_tags(root), **(tags or {})}
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
