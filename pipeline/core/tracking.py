"""MLflow runs behind one small interface; the store is ``MLFLOW_TRACKING_URI`` (default: ``<root>/.mlflow``)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline.core import env, gitstate, owner
from pipeline.core.errors import PipelineError

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "wmt14-transformer"
# Without this tag MLflow 3's UI guesses the experiment's kind and may open it on its GenAI overview; the
# values are the UI's (mlflow/server/js, ExperimentKind: "custom_model_development" = training runs).
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
_CURRENT: contextvars.ContextVar[StageRun | None] = contextvars.ContextVar("nmt_stage_run", default=None)
#: The query that opens a page of MLflow 3's UI on its model-training view: the UI takes the view from the URL's
#: ``workflowType`` (WorkflowType "genai" | "machine_learning" in mlflow/server/js) or the browser's last choice,
#: so MLflow's own "View run at" links (``#/experiments/<id>/runs/<run_id>``) open on the GenAI view.
TRAINING_VIEW = "workflowType=machine_learning"


def ui_url(base: str, experiment_id: str, run_id: str | None = None) -> str:
    """The MLflow UI page at ``base`` of an experiment (or of one of its runs), on its model-training view."""
    page = f"{base.rstrip('/')}/#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return f"{page}?{TRAINING_VIEW}"


def is_server(uri: str) -> bool:
    """Whether ``uri`` is a tracking server (which has a UI of its own), not a local store."""
    return uri.startswith(("http://", "https://"))


def _quiet_links(uri: str) -> None:
    """Keep MLflow's client from printing its run links, which open the GenAI view, for a server; :meth:`StageRun
    .close` logs the run's page on the training view instead (``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT`` set by
    hand is kept)."""
    if is_server(uri):
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def enabled() -> bool:
    """Whether tracking is on (``NMT_TRACKING``)."""
    return env.settings().tracking


def tracking_uri(root: str | Path = ".") -> str:
    """The tracking URI: ``MLFLOW_TRACKING_URI`` or the local SQLite store under ``root``."""
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return uri
    store = Path(root).resolve() / ".mlflow"
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


def store_lock(root: str | Path = ".") -> Path:
    """A lock file for writes that must not interleave in the store: beside a SQLite store's file, else one per
    machine and store URI in the temp folder (processes on other machines are not serialised by it)."""
    uri = tracking_uri(root)
    if uri.startswith("sqlite:///"):  # sqlite:///relative or sqlite:////absolute
        return Path(uri.removeprefix("sqlite:///") + ".lock").absolute()
    return Path(tempfile.gettempdir()) / f"nmt-mlflow-{hashlib.sha256(uri.encode()).hexdigest()[:16]}.lock"


@functools.lru_cache(maxsize=8)  # an answer is kept for the process; a failure is not (it raises)
def require_server(uri: str, timeout_s: float = 5.0) -> None:
    """Raise a one-line PipelineError at once when ``uri`` is an http(s) server whose ``/health`` is silent."""
    if not re.match(r"^https?://", uri):
        return
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s, allow_redirects=False).close()
        return
    except requests.exceptions.SSLError:
        return  # a server answered; TLS settings are MLflow's to apply (MLFLOW_TRACKING_INSECURE_TLS...)
    except requests.exceptions.Timeout:
        reason = f"no answer within {timeout_s:g} s"
    except requests.RequestException as exc:
        inner = getattr(exc.args[0], "reason", None) if exc.args else None
        reason = str(inner or exc).rsplit("): ", 1)[-1]
    shown = re.sub(r"^(https?://)[^/]*@", r"\1***@", uri)
    raise PipelineError(f"MLFLOW_TRACKING_URI={shown}: no tracking server answers ({reason}); start it or set "
                        "MLFLOW_TRACKING_URI to a running server, or set NMT_TRACKING=off to run without tracking")


def require_store(uri: str, timeout_s: float = 5.0) -> None:
    """Raise a one-line PipelineError when ``uri`` is a SQLite store whose file is not a database or stays locked
    for ``timeout_s`` (MLflow's own failure is a SQLAlchemy traceback of some 85 lines). No file: MLflow makes it."""
    if not uri.startswith("sqlite:///") or not (db := Path(uri.removeprefix("sqlite:///"))).is_file():
        return
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True,
                                                timeout=timeout_s)) as conn:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc):
            raise PipelineError(f"{db}: the MLflow store cannot be read ({exc}); check the file's permissions, or "
                                "set NMT_TRACKING=off to run without tracking") from None
        raise PipelineError(f"{db}: the MLflow store stayed locked for {timeout_s:g} s (another process holds a "
                            f"write transaction on it: fuser {db}); let it finish or end it, or set NMT_TRACKING=off "
                            "to run without tracking") from None
    except sqlite3.DatabaseError as exc:
        raise PipelineError(f"{db}: the MLflow store is not a SQLite database ({exc}): move it aside (mv {db} "
                            f"{db}.corrupt) and rerun to start an empty store, or set MLFLOW_TRACKING_URI to another "
                            "store") from None


def require_configured_server() -> None:
    """:func:`require_server` on ``MLFLOW_TRACKING_URI`` when tracking is on and the variable is set."""
    if (uri := os.environ.get("MLFLOW_TRACKING_URI")) and enabled():
        require_server(uri)


def mlflow_client(root: str | Path = ".") -> Any:
    """An MLflow client on :func:`tracking_uri` (tracking and registry), its server checked first."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(root)
    require_server(uri)
    require_store(uri)
    _quiet_links(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def git_tags(root: str | Path = ".", *, temporary_params: bool = False) -> dict[str, str]:
    """Git commit and dirty flag of ``root`` (empty outside a git checkout) by :mod:`pipeline.core.gitstate`'s rule,
    with MLflow's standard source tags (:func:`source_tags`)."""
    if (commit := gitstate.commit(root)) is None:
        return {"git_commit": "", "git_dirty": "", **source_tags(root, None)}
    dirty = gitstate.dirty_paths(root, temporary_params=temporary_params)
    return {"git_commit": commit, "git_dirty": str(bool(dirty)).lower(), **source_tags(root, commit)}


def source_tags(root: str | Path, commit: str | None) -> dict[str, str]:
    """The tags MLflow's fluent ``start_run`` sets and its UI shows as a run's Source (``mlflow.source.name``,
    ``.type``, ``mlflow.user``; ``mlflow.source.git.commit``, ``.branch``, ``.repoURL`` of ``root`` where known):
    the client's ``create_run`` sets none. MLflow's own context providers and git helpers (credentials stripped
    from the remote's URL), the checkout being ``root`` rather than the main file's."""
    from mlflow.tracking.context.default_context import DefaultRunContext
    from mlflow.utils import mlflow_tags
    from mlflow.utils.git_utils import get_git_branch, get_git_repo_url

    tags = dict(DefaultRunContext().tags())
    if commit:
        where = str(Path(root).resolve())
        found = {mlflow_tags.MLFLOW_GIT_COMMIT: commit, mlflow_tags.MLFLOW_GIT_BRANCH: get_git_branch(where),
                 mlflow_tags.MLFLOW_GIT_REPO_URL: get_git_repo_url(where)}
        tags.update({k: v for k, v in found.items() if v})
    return tags


class StageRun:
    """A handle on one MLflow run, no-ops when tracking is off; a stage's handle opens its run on first use."""

    def __init__(self, client: Any = None, run_id: str | None = None,
                 opener: Callable[[str | None], tuple[Any, str]] | None = None) -> None:
        self._client, self._run_id, self._opener = client, run_id, opener
        self._resume_id: str | None = None
        self._queued: dict[str, Any] = {}
        self._monitor: Any = None
        self.system_metrics = False  # set before the run opens: sample CPU, memory, disk, GPU into it

    @property
    def opened(self) -> bool:
        """Whether the run exists (a lazy stage run that nothing used has not been created)."""
        return self._client is not None

    @property
    def client(self) -> Any:
        """The run's MLflow client (opens a lazy run); None when tracking is off."""
        self._live()
        return self._client

    @property
    def run_id(self) -> str | None:
        """The run's id (opens a lazy run); None when tracking is off."""
        self._live()
        return self._run_id

    def open(self) -> None:
        """Create (or continue) the run now rather than on first use."""
        self._live()

    def resume(self, run_id: str | None) -> None:
        """Continue ``run_id`` (a resumed training) instead of creating a run; call before any logging."""
        if self._opener is not None and run_id:
            self._resume_id = run_id

    def queue_params(self, params: dict[str, Any]) -> None:
        """Params to log when a new run opens (not a resumed one)."""
        self._queued.update(params)

    def _live(self) -> bool:
        if self._client is None and self._opener is not None:
            opener, self._opener = self._opener, None
            self._client, self._run_id = opener(self._resume_id)
            if self._resume_id is None and self._queued:
                self.log_params(self._queued)
            if self.system_metrics:  # MLflow's system/* metrics (GPUs need nvidia-ml-py)
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                self._monitor = SystemMetricsMonitor(self._run_id, resume_logging=self._resume_id is not None,
                                                     tracking_uri=self._client.tracking_uri)
                self._monitor.start()
        return self._client is not None

    def close(self, status: str) -> None:
        """Stop the system metrics monitor and end the run with ``status``."""
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
        if self._client is not None:
            end_run(self._client, self._run_id, status)

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params (values stringified, 500-char limit respected) in batches."""
        if not self._live():
            return
        from mlflow.entities import Param

        items = [Param(k, str(v)[:500]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self._client.log_batch(self._run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log numeric metrics at ``step`` (non-numbers are skipped)."""
        if not self._live():
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if items:
            self._client.log_batch(self._run_id, metrics=items)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set string tags."""
        if self._live():
            for k, v in tags.items():
                self._client.set_tag(self._run_id, k, str(v))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or directory as an artifact."""
        if self._live():
            self._client.log_artifact(self._run_id, str(path), artifact_path)


def end_run(client: Any, run_id: str, status: str) -> None:
    """End ``run_id`` with ``status``; on a server, log its page on the UI's training view (:func:`ui_url`)."""
    client.set_terminated(run_id, status=status)
    if is_server(uri := str(client.tracking_uri)):
        log.info("MLflow run %s (%s): %s", run_id, status, ui_url(uri, client.get_run(run_id).info.experiment_id,
                                                                  run_id))


def experiment_id(client: Any, root: str | Path) -> str:
    """The experiment's id, created (or tagged) so that MLflow 3's UI opens it on its runs table."""
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)
    if (exp := client.get_experiment_by_name(name)) is not None:
        if EXPERIMENT_KIND_TAG not in exp.tags:
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id
    # A SQLite store keeps its artifacts beside the database (never ./mlruns in the cwd); a server decides itself.
    sqlite = (uri := tracking_uri(root)).startswith("sqlite:///")
    location = (Path(uri[len("sqlite:///"):]).parent / "artifacts").resolve().as_uri() if sqlite else None
    return client.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})


@contextlib.contextmanager
def stage_run(stage: str, *, root: str | Path = ".", active: bool = True,
              system_metrics: bool = False) -> Iterator[StageRun]:
    """One stage's :class:`StageRun`, opened on first use but dated from the block's start (no-op if not ``active``)."""
    if not (active and enabled()):
        handle = StageRun()
    else:
        require_configured_server()  # before the stage's work, not when its run first opens
        require_store(tracking_uri(root))
        started_ms = int(time.time() * 1000)
        handle = StageRun(opener=lambda resume: _open_stage_run(stage, Path(root), resume, started_ms))
        handle.system_metrics = system_metrics
    token = _CURRENT.set(handle)
    status = "FAILED"
    try:
        yield handle
        status = "FINISHED"
    finally:
        _CURRENT.reset(token)
        if handle.opened:
            try:
                handle.close(status)
            except Exception as exc:  # noqa: BLE001 - tracking must never mask the stage's own error
                log.warning("could not close MLflow run %s: %s", handle._run_id, exc)


def system_metrics_wanted(stage: str, device: str | None, cuda_available: bool) -> bool:
    """Whether ``stage``'s run samples system metrics: the train run on CUDA (``device``: ``NMT_DEVICE``)."""
    return stage == "train" and cuda_available and device != "cpu"


def _open_stage_run(stage: str, root: Path, resume_run_id: str | None, started_ms: int) -> tuple[Any, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(uri := tracking_uri(root)))
    _quiet_links(uri)
    if resume_run_id:
        client.update_run(resume_run_id, status="RUNNING")
        for key, value in owner.owner_tags(root).items():  # this process holds it open now
            client.set_tag(resume_run_id, key, value)
        return client, resume_run_id
    s = env.settings()
    tags = {"stage": stage, "mlflow.runName": stage, **git_tags(root, temporary_params=bool(s.profile_run)),
            **owner.owner_tags(root)}
    optional = {"profile": s.profile_run, "mlflow.parentRunId": os.environ.get("MLFLOW_PARENT_RUN_ID"),
                "prefect.flow_run_id": s.prefect_flow_run_id}
    tags.update({k: v for k, v in optional.items() if v})
    run = client.create_run(experiment_id(client, root), start_time=started_ms, tags=tags, run_name=stage)
    return client, run.info.run_id


def current() -> StageRun:
    """The run of the stage being executed (inside :func:`stage_run`), else a no-op handle."""
    return _CURRENT.get() or StageRun()


def end_orphaned_runs(root: str | Path = ".",
                      logger: logging.Logger | logging.LoggerAdapter | None = None) -> list[str]:
    """Mark ``KILLED`` the runs of ``root`` left ``RUNNING`` by a process that is gone; return their ids."""
    if not enabled():
        return []
    client = mlflow_client(root)
    exp = client.get_experiment_by_name(os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT))
    return [] if exp is None else owner.end_orphans(client, exp.experiment_id, root, logger or log)
