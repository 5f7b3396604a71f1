"""The MLflow store: where it is (``MLFLOW_TRACKING_URI``, default ``<root>/.mlflow``), whether it answers, its
client, the experiment and the UI's pages."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from pipeline.core import env
from pipeline.core.errors import PipelineError

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "wmt14-transformer"
# Without this tag MLflow 3's UI guesses the experiment's kind and may open it on its GenAI overview; the
# values are the UI's (mlflow/server/js, ExperimentKind: "custom_model_development" = training runs).
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
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



def experiment_name() -> str:
    """The experiment the runs go to: ``MLFLOW_EXPERIMENT_NAME``, else :data:`DEFAULT_EXPERIMENT`."""
    return os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)


def experiment_id(client: Any, root: str | Path) -> str:
    """The experiment's id, created (or tagged) so that MLflow 3's UI opens it on its runs table."""
    if (exp := client.get_experiment_by_name(name := experiment_name())) is not None:
        if EXPERIMENT_KIND_TAG not in exp.tags:
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id
    # A SQLite store keeps its artifacts beside the database (never ./mlruns in the cwd); a server decides itself.
    sqlite = (uri := tracking_uri(root)).startswith("sqlite:///")
    location = (Path(uri[len("sqlite:///"):]).parent / "artifacts").resolve().as_uri() if sqlite else None
    return client.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})


def ui_page(run_id: str, root: str | Path = ".", port: int = 5000) -> str | None:
    """On MLflow's training view (not MLflow 3's GenAI view): a server's page of ``run_id``, else the local
    ``mlflow ui``'s page of its experiment; None (with a warning) when the run cannot be read."""
    try:
        experiment = mlflow_client(root).get_run(run_id).info.experiment_id
    except Exception as exc:  # noqa: BLE001 - a link is never worth failing a run
        log.warning("could not read the experiment of run %s: %s", run_id, exc)
        return None
    if is_server(uri := tracking_uri(root)):
        return ui_url(uri, experiment, run_id)
    return ui_url(f"http://127.0.0.1:{port}", experiment)
