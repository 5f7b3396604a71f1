"""Test-wide environment: telemetry off, tool homes in temporary dirs, tracking off by default.

Set before anything imports prefect or mlflow. Tests that exercise tracking opt in with the
``mlflow_sqlite`` fixture.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

_HOME = Path(tempfile.mkdtemp(prefix="nmt-tests-"))
os.environ.update(
    PREFECT_HOME=str(_HOME / "prefect"),
    PREFECT_SERVER_ANALYTICS_ENABLED="false",
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="90",
    MLFLOW_DISABLE_TELEMETRY="true",
    DO_NOT_TRACK="true",
    DVC_NO_ANALYTICS="1",
    SACREBLEU=str(_HOME / "sacrebleu"),
    NMT_TRACKING="off",
    OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    NMT_DOWNLOAD_CACHE=str(_HOME / "download-cache"),
)
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("MLFLOW_PARENT_RUN_ID", None)
os.environ.pop("NMT_DATA_MIRROR", None)
# Subprocesses (dvc, torchrun, python -m pipeline.*) must find this interpreter's tools first.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

REPO = Path(__file__).resolve().parents[1]


def shared_data() -> Path:
    """The real EN-DE data folder (read-only), if this machine has one: ``$NMT_SHARED_DATA``, else
    ``shared/data`` beside the checkout (as in CI), else /work/shared/data. Tests that need it skip
    when it is absent, so a fresh clone anywhere still passes."""
    for candidate in (os.environ.get("NMT_SHARED_DATA"), REPO.parent / "shared" / "data", "/work/shared/data"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return REPO / "no-shared-data"


SHARED = shared_data()


@pytest.fixture
def repo_root() -> Path:
    """The repository root (to read params.yaml, profiles/ and dvc.yaml)."""
    return REPO


@pytest.fixture
def mlflow_sqlite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Tracking on, against a fresh SQLite store in ``tmp_path``; returns the URI."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("NMT_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests when CUDA is not available."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
