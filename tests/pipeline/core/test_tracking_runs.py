"""Stage runs in MLflow (SQLite): they span the stage's work, carry its plots, tell the UI they are training runs,
and tag dirtiness honestly during a profile run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.core import tracking
from pipeline.core.config import load_params
from pipeline.core.stage import run_stage
from pipeline.project.profiles import write_profile
from tests.helpers.paths import REPO
from tests.helpers.repoutil import git


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


@pytest.mark.parametrize("stage", ["audit", "average", "train", "register"])
def test_a_stage_run_spans_the_stage_body(stage: str, tmp_path: Path, mlflow_sqlite: str) -> None:
    """[start_time, end_time] of the run holds the body's own start and end; lazy runs (train, register) included."""
    stamps: dict[str, float] = {}

    def body() -> dict[str, Any]:
        stamps["start"] = time.time()
        time.sleep(0.3)  # work before the stage first touches its run (a lazy run opens only now)
        tracking.current().log_metrics({"x": 1.0})
        time.sleep(0.2)
        stamps["end"] = time.time()
        return {"ok": 1}

    details = run_stage(stage, body, metrics_dir=tmp_path / "metrics", root=tmp_path)
    info = _client(mlflow_sqlite).get_run(details["mlflow_run_id"]).info
    assert info.status == "FINISHED"
    assert info.start_time <= int(stamps["start"] * 1000), (info.start_time, stamps)
    assert info.end_time >= int(stamps["end"] * 1000), (info.end_time, stamps)
    assert (info.end_time - info.start_time) / 1000 >= 0.5


def test_the_train_run_logs_its_plots(tmp_path: Path, mlflow_sqlite: str) -> None:
    params = load_params(write_profile("tiny", REPO, tmp_path / "params.yaml"))
    plots = tmp_path / params.paths.plots

    def body() -> dict[str, Any]:
        plots.mkdir(parents=True, exist_ok=True)
        (plots / "train.csv").write_text("step,loss\n1,9.0\n")
        (plots / "train.png").write_bytes(b"\x89PNG\r\n\x1a\n")
        tracking.current().log_metrics({"loss": 9.0})
        return {"step": 1}

    details = run_stage("train", body, metrics_dir=tmp_path / params.paths.metrics, params=params, root=tmp_path)
    logged = {a.path for a in _client(mlflow_sqlite).list_artifacts(details["mlflow_run_id"], "plots")}
    assert logged == {"plots/train.csv", "plots/train.png"}


@pytest.mark.parametrize(("stage", "device", "cuda", "wanted"), [
    ("train", None, True, True), ("train", "cuda", True, True), ("train", "cpu", True, False),
    ("train", None, False, False), ("evaluate", None, True, False)])
def test_system_metrics_only_for_training_on_cuda(stage: str, device: str | None, cuda: bool, wanted: bool) -> None:
    assert tracking.system_metrics_wanted(stage, device, cuda) is wanted


def test_a_monitored_run_gets_mlflows_system_metrics(tmp_path: Path, mlflow_sqlite: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    with tracking.stage_run("train", root=tmp_path, system_metrics=True) as run:
        run.open()
        time.sleep(1.0)
    metrics = _client(mlflow_sqlite).get_run(run.run_id).data.metrics
    assert any(key.startswith("system/cpu_utilization") for key in metrics), sorted(metrics)


def test_a_new_experiment_opens_on_its_training_runs(tmp_path: Path, mlflow_sqlite: str) -> None:
    with tracking.stage_run("audit", root=tmp_path) as run:
        run.open()
    client = _client(mlflow_sqlite)
    exp = client.get_experiment_by_name(tracking.DEFAULT_EXPERIMENT)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    other = client.create_experiment("made-elsewhere")  # an older store's experiment gets the tag on next use
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_EXPERIMENT_NAME", "made-elsewhere")
        with tracking.stage_run("audit", root=tmp_path) as run:
            run.open()
    assert client.get_experiment(other).tags["mlflow.experimentKind"] == "custom_model_development"


def test_dirty_ignores_the_runs_own_records_and_the_profile_runs_params_yaml(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "test")
    (tmp_path / "params.yaml").write_text("profile: paper\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "dvc.lock").write_text("stages: {}\n# first run\n")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train.json").write_text('{"step": 1}\n')
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "x")
    assert tracking.git_tags(tmp_path)["git_dirty"] == "false"
    (tmp_path / "params.yaml").write_text("profile: tiny\n")  # what a profile run writes
    assert tracking.git_tags(tmp_path)["git_dirty"] == "true"
    assert tracking.git_tags(tmp_path, temporary_params=True)["git_dirty"] == "false"
    (tmp_path / "dvc.lock").write_text("stages: {}\n")  # the run's own records never count
    (tmp_path / "metrics" / "train.json").write_text('{"step": 2}\n')
    assert tracking.git_tags(tmp_path, temporary_params=True)["git_dirty"] == "false"
    (tmp_path / "code.py").write_text("x = 2\n")  # a real uncommitted change still counts
    assert tracking.git_tags(tmp_path, temporary_params=True)["git_dirty"] == "true"
