"""MLflow's logged and registered models and a run's dataset inputs, for the ``register`` stage (tracking on)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.tracking.runs import StageRun
from pipeline.tracking.store import mlflow_client, tracking_uri

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelVersion:
    """A registered model version: its number, the run that logged it (its ``run_id`` tag first) and its tags."""

    version: str
    run_id: str | None
    tags: dict[str, str]


@dataclass(frozen=True)
class LoggedModel:
    """A logged model's URI and id, and its registered version (None when not registered)."""

    model_uri: str
    model_id: str | None
    version: str | None


@contextlib.contextmanager
def _fluent_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API at ``uri`` for a block, restoring its URI and ``MLFLOW_TRACKING_URI`` after."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    saved_env = os.environ.get("MLFLOW_TRACKING_URI")
    saved = getattr(utils, "_tracking_uri", None)
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved)
        if saved_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved_env


def log_pyfunc_model(run: StageRun, *, python_model: str | Path, artifacts: dict[str, str],
                     code_paths: list[str] | None = None, model_config: dict[str, int | float | str] | None = None,
                     params: dict[str, int | float | str] | None = None, registered_model_name: str | None = None,
                     pip_requirements: list[str] | None = None, name: str = "translator",
                     input_example: list[str] | None = None, root: str | Path = ".") -> LoggedModel | None:
    """Log a models-from-code pyfunc (one column in, one string per row out) into ``run``; maybe register it.

    ``params``: the inference params with their defaults (part of the signature); ``input_example``: source lines
    MLflow stores beside the model (the UI's and ``mlflow models predict``'s example) and, before the model is
    logged, serves once through the model as its check; the rest are ``mlflow.pyfunc.log_model``'s. Returns the
    logged (and maybe registered) model, or None when off.
    """
    if run.run_id is None:
        return None
    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    def kind(v: int | float | str) -> str:
        return "string" if isinstance(v, str) else "long" if type(v) is int else "double"  # True: not a long

    specs = [ParamSpec(k, kind(v), v) for k, v in (params or {}).items()]
    # A string input schema: MLflow enforces it before the model is reached (_enforce_schema in
    # mlflow/models/utils.py), keeping column 0 of a wider table and refusing non-strings in its own words; `nmt
    # serve`'s guard reads the request's one column itself first (pipeline/inference/serving.py).
    signature = ModelSignature(inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
                               params=ParamSchema(specs) if specs else None)
    # The fluent API logs into the active run: make the stage's run active against this store for
    # the call only (the registry follows the tracking URI unless MLFLOW_REGISTRY_URI says otherwise).
    with _fluent_tracking_uri(tracking_uri(root)), mlflow.start_run(run_id=run.run_id):
        info = mlflow.pyfunc.log_model(
            name=name, python_model=str(python_model), artifacts=artifacts, code_paths=code_paths,
            model_config=model_config, signature=signature, registered_model_name=registered_model_name,
            pip_requirements=pip_requirements, input_example=input_example)
    version = getattr(info, "registered_model_version", None)
    return LoggedModel(model_uri=info.model_uri, model_id=getattr(info, "model_id", None),
                       version=str(version) if version is not None else None)


def log_datasets(run: StageRun, datasets: list[dict[str, str]]) -> None:
    """Record dataset inputs of ``run`` (each ``{"name", "digest", "source", "context"}``; source type ``dvc``)."""
    if not datasets or run.run_id is None:
        return
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = [DatasetInput(Dataset(name=d["name"], digest=d["digest"][:36], source_type="dvc", source=d["source"]),
                           tags=[InputTag("mlflow.data.context", d.get("context", "training"))])
              for d in datasets]
    run.client.log_inputs(run.run_id, datasets=inputs)


def _version(mv: Any) -> ModelVersion:
    tags = dict(mv.tags or {})
    return ModelVersion(version=str(mv.version), run_id=tags.get("run_id") or mv.run_id, tags=tags)


def alias_holder(model_name: str, alias: str, root: str | Path = ".") -> ModelVersion | None:
    """The model version holding ``alias``, or None (no model, no alias)."""
    from mlflow.exceptions import MlflowException

    try:
        return _version(mlflow_client(root).get_model_version_by_alias(model_name, alias))
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def find_model_versions(model_name: str, tags: dict[str, str | float], root: str | Path = ".") -> list[ModelVersion]:
    """Versions of ``model_name`` whose tags equal all of ``tags`` (as strings; newest first)."""
    quoted = model_name.replace("'", "\\'")
    clauses = [f"name = '{quoted}'", *(f"tag.`{k}` = '{v!s}'" for k, v in tags.items())]
    found = mlflow_client(root).search_model_versions(" and ".join(clauses), order_by=["version_number DESC"])
    return [_version(mv) for mv in found]


def set_alias(model_name: str, alias: str, version: str, root: str | Path = ".") -> None:
    """Point ``alias`` of ``model_name`` at ``version``."""
    mlflow_client(root).set_registered_model_alias(model_name, alias, str(version))


def tag_model_version(model_name: str, version: str, tags: dict[str, str | float], root: str | Path = ".") -> None:
    """Set string tags on one registered model version."""
    client = mlflow_client(root)
    for key, value in tags.items():
        client.set_model_version_tag(model_name, str(version), key, str(value))


def download_run_artifact(run_id: str, artifact_path: str, dst_dir: str | Path, root: str | Path = ".") -> Path | None:
    """Fetch one artifact of a run into ``dst_dir``; None when it is absent."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=artifact_path, dst_path=str(dst_dir),
                                                    tracking_uri=tracking_uri(root))
    except (MlflowException, OSError) as exc:
        log.warning("run %s has no artifact %s: %s", run_id, artifact_path, exc)
        return None
    return Path(local)


def describe_model(model_name: str, description: str, tags: dict[str, str], root: str | Path = ".") -> None:
    """Set the registered model's description and tags (what the MLflow UI's model page shows)."""
    client = mlflow_client(root)
    client.update_registered_model(model_name, description=description)
    for key, value in tags.items():
        client.set_registered_model_tag(model_name, key, value)

