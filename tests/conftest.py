"""Test-wide environment: telemetry off, tool homes in temporary dirs, tracking off by default.

Set before anything imports prefect or mlflow. Tests that exercise tracking opt in with the
``mlflow_sqlite`` fixture.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

pytest_plugins = ["tests.helpers.reaper"]  # no process a test started outlives the session

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


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One real Prefect API (temporary SQLite database) for the rest of the session.

    Session-scoped, so the harness (temporary SQLite database and server, ~10 s to start) is paid
    once per session, whichever modules ask for it.
    """
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def eval_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The evaluate stage's world: averaged.pt + clean/raw text + shards encoded by the real encode stage.

    Built once per session (test_evaluate, test_bad_input): read it, or change a copy.
    """
    from tests.helpers.eval_world import build_eval_world

    return build_eval_world(tmp_path_factory.mktemp("eval"))


@pytest.fixture(scope="session")
def audit_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete tiny-profile workspace produced by the real stages (~10 s), with a stand-in dvc.lock.

    Built once per session (test_audit, test_audit_replay): read it, or change a copy.
    """
    from tests.helpers.audit_world import build_audit_world

    return build_audit_world(tmp_path_factory.mktemp("audit-world"))


@pytest.fixture(scope="session")
def tiny_built(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The tiny project after a whole ``dvc repro`` (``tests/helpers/tinyproject.py``), built once per run: under
    pytest-xdist the workers share it. Its project folder is ``tiny_built / "project"``: read it, or change a copy
    (``copy_built``) with ``built_env(tiny_built)`` set.
    """
    from tests.helpers.tinyproject import built_once

    base = tmp_path_factory.getbasetemp()
    return built_once((base.parent if hasattr(request.config, "workerinput") else base) / "tiny-built")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests when CUDA is not available; under pytest-xdist, put the files that hold a ``slow``
    test first (``make test`` hands out whole files in this order: the long ones start first, the short ones fill
    in at the end)."""
    if hasattr(config, "workerinput"):  # an xdist worker
        slow = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow)  # stable: a file's tests keep their order
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
