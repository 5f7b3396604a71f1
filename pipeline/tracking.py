"""MLflow, behind one small interface. The only module that imports ``mlflow``; no torch here.

Environment:
    NMT_TRACKING=off          disable tracking (every call becomes a no-op; run ids are None)
    MLFLOW_TRACKING_URI       a server or store; default ``sqlite:///<root>/.mlflow/mlflow.db``
    MLFLOW_EXPERIMENT_NAME    default ``wmt14-transformer``
    MLFLOW_PARENT_RUN_ID      set by whoever starts a pipeline run; stage runs become its children
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "wmt14-transformer"


def enabled() -> bool:
    """Whether tracking is on (``NMT_TRACKING`` not in off/0/false/no)."""
    return os.environ.get("NMT_TRACKING", "on").strip().lower() not in ("off", "0", "false", "no")


def tracking_uri(root: str | Path = ".") -> str:
    """The tracking URI: ``MLFLOW_TRACKING_URI`` or the local SQLite store under ``root``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    store = Path(root).resolve() / ".mlflow"
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


def git_tags(root: str | Path = ".") -> dict[str, str]:
    """Git commit and dirty flag of ``root`` (empty values outside a git checkout)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": str(bool(dirty)).lower() if commit else ""}


class StageRun:
    """A handle on one MLflow run; every method is a no-op when tracking is off."""

    def __init__(self, client: Any = None, run_id: str | None = None) -> None:
        self._client = client
        self.run_id = run_id

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params (values stringified, 500-char limit respected) in batches."""
        if not self._client:
            return
        from mlflow.entities import Param

        items = [Param(k, str(v)[:500]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log numeric metrics at ``step`` (non-numbers are skipped)."""
        if not self._client:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if items:
            self._client.log_batch(self.run_id, metrics=items)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set string tags."""
        if self._client:
            for k, v in tags.items():
                self._client.set_tag(self.run_id, k, str(v))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or directory as an artifact."""
        if self._client:
            self._client.log_artifact(self.run_id, str(path), artifact_path)


def _experiment_id(client: Any, root: Path) -> str:
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    # A SQLite store keeps its artifacts beside the database (never ./mlruns in the cwd);
    # a tracking server decides for itself.
    location = None
    uri = tracking_uri(root)
    if uri.startswith("sqlite:///"):
        location = (Path(uri[len("sqlite:///"):]).parent / "artifacts").resolve().as_uri()
    return client.create_experiment(name, artifact_location=location)


@contextlib.contextmanager
def stage_run(stage: str, *, root: str | Path = ".", resume_run_id: str | None = None,
              active: bool = True) -> Iterator[StageRun]:
    """Open (or continue) the MLflow run of one stage; yields a :class:`StageRun`.

    Args:
        stage: stage name, used as run name and ``stage`` tag.
        root: repository root (for the default store and git tags).
        resume_run_id: continue this run (a resumed training) instead of creating one.
        active: False on non-zero ranks: yields a no-op handle.
    """
    if not (active and enabled()):
        yield StageRun()
        return
    from mlflow.tracking import MlflowClient

    root = Path(root)
    client = MlflowClient(tracking_uri=tracking_uri(root))
    if resume_run_id:
        run_id = resume_run_id
        client.update_run(run_id, status="RUNNING")
    else:
        tags = {"stage": stage, "mlflow.runName": stage, **git_tags(root)}
        parent = os.environ.get("MLFLOW_PARENT_RUN_ID")
        if parent:
            tags["mlflow.parentRunId"] = parent
        run_id = client.create_run(_experiment_id(client, root), tags=tags, run_name=stage).info.run_id
    handle = StageRun(client, run_id)
    status = "FAILED"
    try:
        yield handle
        status = "FINISHED"
    finally:
        try:
            client.set_terminated(run_id, status=status)
        except Exception as exc:  # noqa: BLE001 - tracking must never mask the stage's own error
            log.warning("could not close MLflow run %s: %s", run_id, exc)


@contextlib.contextmanager
def pipeline_run(name: str, *, params: dict[str, Any], root: str | Path = ".",
                 tags: dict[str, str] | None = None) -> Iterator[StageRun]:
    """Open the parent run of one pipeline run; stage runs find it via ``MLFLOW_PARENT_RUN_ID``.

    Logs the flattened params once and ``params.yaml`` as an artifact. The caller exports
    ``MLFLOW_PARENT_RUN_ID`` only to the child processes it starts (never globally).
    """
    if not enabled():
        yield StageRun()
        return
    from mlflow.tracking import MlflowClient

    root = Path(root)
    client = MlflowClient(tracking_uri=tracking_uri(root))
    all_tags = {"mlflow.runName": name, "pipeline": "true", **git_tags(root), **(tags or {})}
    run_id = client.create_run(_experiment_id(client, root), tags=all_tags, run_name=name).info.run_id
    handle = StageRun(client, run_id)
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
    if enabled() and run_id:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri(root))
        for k, v in tags.items():
            client.set_tag(run_id, k, str(v))
