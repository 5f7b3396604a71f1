"""The app ``nmt serve`` runs: MLflow's own scoring server (``mlflow.pyfunc.scoring_server.init``) for the model at
``_SERVER_MODEL_PATH``, behind :mod:`pipeline.inference.serving`'s guard."""

from __future__ import annotations

import os
import shlex

from pipeline.inference.serving import App, guard


def serve_command(model_uri: str, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """What ``mlflow models serve --env-manager local`` runs for ``model_uri`` (``scoring_server.get_cmd``: uvicorn,
    the model downloaded, its path and the request timeout in the environment), with this module's guarded
    :data:`app` instead of ``mlflow.pyfunc.scoring_server.app:app``."""
    from mlflow.artifacts import download_artifacts
    from mlflow.pyfunc import scoring_server

    command, command_env = scoring_server.get_cmd(download_artifacts(model_uri), port=port, host=host)
    argv = [a if a != "mlflow.pyfunc.scoring_server.app:app" else f"{__name__}:app" for a in shlex.split(command)]
    return argv, command_env


def build_app() -> App:
    """MLflow's scoring app for the model at ``_SERVER_MODEL_PATH`` (set by ``scoring_server.get_cmd``), guarded."""
    from mlflow.pyfunc import scoring_server

    model = scoring_server.load_model_with_mlflow_config(os.environ[scoring_server._SERVER_MODEL_PATH])
    schema = model.metadata.get_params_schema()
    known = tuple(p.name for p in schema.params) if schema is not None else ()
    return guard(scoring_server.init(model), known)


def __getattr__(name: str) -> App:
    """``app``, built on first use: uvicorn's ``pipeline.tracking.scoring_app:app`` loads the model then, not an
    import of this module (PEP 562)."""
    if name != "app":
        raise AttributeError(name)
    globals()["app"] = built = build_app()
    return built
