"""Stage runs in MLflow (SQLite): they span the stage's work, carry its plots, tell the UI they are training runs,
and tag dirtiness honestly during a profile run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline import tracking
from pipeline.core.config import load_params
from pipeline.core.details import RECORDS, AuditDetails, StageDetails, TrainDetails
from pipeline.core.errors import PipelineError
from pipeline.project.profiles import merged_profile, write_profile
from pipeline.tracking.harness import run_stage
from tests.helpers.paths import REPO
from tests.helpers.repoutil import git


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


@pytest.mark.parametrize("stage", ["audit", "average", "train", "register"])
@pytest.mark.slow
def test_a_stage_run_spans_the_stage_body(stage: str, tmp_path: Path, mlflow_sqlite: str) -> None:
    """[start_time, end_time] of the run holds the body's own start and end; lazy runs (train, register) included."""
    stamps: dict[str, float] = {}

    def body() -> StageDetails:
        stamps["start"] = time.time()
        time.sleep(0.3)  # work before the stage first touches its run (a lazy run opens only now)
        tracking.current().log_metrics({"x": 1.0})
        time.sleep(0.2)
        stamps["end"] = time.time()
        return RECORDS[stage]()

    details = run_stage(stage, body, metrics_dir=tmp_path / "metrics", root=tmp_path)
    info = _client(mlflow_sqlite).get_run(details.mlflow_run_id).info
    assert info.status == "FINISHED"
    assert info.start_time <= int(stamps["start"] * 1000), (info.start_time, stamps)
    assert info.end_time >= int(stamps["end"] * 1000), (info.end_time, stamps)
    assert (info.end_time - info.start_time) / 1000 >= 0.5


def test_the_train_run_logs_its_plots(tmp_path: Path, mlflow_sqlite: str) -> None:
    params = load_params(write_profile("tiny", REPO, tmp_path / "params.yaml"))
    plots = tmp_path / params.paths.plots

    def body() -> TrainDetails:
        plots.mkdir(parents=True, exist_ok=True)
        (plots / "train.csv").write_text("step,loss\n1,9.0\n")
        (plots / "train.png").write_bytes(b"\x89PNG\r\n\x1a\n")
        tracking.current().log_metrics({"loss": 9.0})
        return TrainDetails(step=1)

    details = run_stage("train", body, metrics_dir=tmp_path / params.paths.metrics, params=params, root=tmp_path)
    logged = {a.path for a in _client(mlflow_sqlite).list_artifacts(details.mlflow_run_id, "plots")}
    assert logged == {"plots/train.csv", "plots/train.png"}


@pytest.mark.parametrize(("stage", "device", "cuda", "wanted"), [
    ("train", None, True, True), ("train", "cuda", True, True), ("train", "cpu", True, False),
    ("train", None, False, False), ("evaluate", None, True, False)])
def test_system_metrics_only_for_training_on_cuda(stage: str, device: str | None, cuda: bool, wanted: bool) -> None:
    assert tracking.system_metrics_wanted(stage, device, cuda) is wanted


@pytest.mark.slow
def test_a_monitored_run_gets_mlflows_system_metrics(tmp_path: Path, mlflow_sqlite: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    with tracking.stage_run("train", root=tmp_path, system_metrics=True) as run:
        run.open()
        time.sleep(1.0)
    metrics = _client(mlflow_sqlite).get_run(run.run_id).data.metrics
    assert any(key.startswith("system/cpu_utilization") for key in metrics), sorted(metrics)


@pytest.mark.slow
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


def test_a_stage_run_carries_mlflows_source_tags_of_its_checkout(tmp_path: Path, mlflow_sqlite: str) -> None:
    """What the UI's Source column reads: commit, branch, the remote's URL without its credentials, name, type."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "feature")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "test")
    git(repo, "remote", "add", "origin", "https://someone:password@example.com/team/wmt14.git")
    (repo / "code.py").write_text("x = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "x")
    details = run_stage("audit", AuditDetails, metrics_dir=tmp_path / "metrics", root=repo)
    tags = _client(mlflow_sqlite).get_run(details.mlflow_run_id).data.tags
    assert tags["mlflow.source.git.commit"] == tags["git_commit"] == git(repo, "rev-parse", "HEAD")
    assert tags["mlflow.source.git.branch"] == "feature"
    assert tags["mlflow.source.git.repoURL"] == "https://example.com/team/wmt14.git"
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.source.name"] == sys.argv[0]
    outside = run_stage("audit", AuditDetails, metrics_dir=tmp_path / "m2", root=tmp_path / "m2")
    bare = _client(mlflow_sqlite).get_run(outside.mlflow_run_id).data.tags  # not a checkout: no git tags
    assert "mlflow.source.git.commit" not in bare and bare["mlflow.source.type"] == "LOCAL"


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


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _refusal(port: int) -> str:
    return (f"MLFLOW_TRACKING_URI=http://***@127.0.0.1:{port}: no tracking server answers (Failed to establish a "
            "new connection: [Errno 111] Connection refused); start it or set MLFLOW_TRACKING_URI to a running "
            "server, or set NMT_TRACKING=off to run without tracking")


def test_an_unreachable_tracking_server_fails_the_stage_before_its_work(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Within seconds (MLflow's own retries took 4 minutes and a 109-line traceback), the body never run."""
    port = _closed_port()
    monkeypatch.setenv("NMT_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:password@127.0.0.1:{port}")
    ran: list[int] = []
    start = time.monotonic()
    with pytest.raises(PipelineError) as info:
        run_stage("download", lambda: ran.append(1) or {}, metrics_dir=tmp_path / "metrics", root=tmp_path)
    assert time.monotonic() - start < 10 and ran == []
    assert str(info.value) == _refusal(port)
    # the stage's command line: one line on stderr, exit 1
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(merged_profile("tiny", REPO)), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "pipeline.download", "--params", "params.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: stage download: {_refusal(port)}"]


def test_a_server_that_answers_anything_passes_and_a_silent_one_times_out(tmp_path: Path) -> None:
    from tests.helpers.httpserver import serve

    with serve(tmp_path) as (url, faults):
        tracking.require_server(url)  # 404 for /health: a server is there, MLflow reports the rest
    assert faults.log == [("/health", None, 404)]
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(PipelineError, match=rf"^MLFLOW_TRACKING_URI={url}: no tracking server answers "
                                                r"\(no answer within 0.5 s\)"):
            tracking.require_server(url, 0.5)


def _killed_stage_run(root: Path, stage: str) -> str:
    """A stage process that opens its MLflow run and is SIGKILLed inside it (no code runs to close it)."""
    script = ("import os, signal, sys; from pipeline import tracking\n"
              "with tracking.stage_run(sys.argv[1], root=sys.argv[2]) as run:\n"
              "    print(run.run_id, flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", script, stage, str(root)], cwd=REPO, capture_output=True,
                          text=True, check=False, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == -9, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.slow
def test_runs_a_killed_process_left_running_are_ended_at_the_next_start(tmp_path: Path, mlflow_sqlite: str) -> None:
    """Only runs of this checkout (or a clone in it) whose owner on this host is gone: a live owner's run, another
    checkout's, another host's and one without an owner tag stay RUNNING."""
    from pipeline.core.owner import owner
    from pipeline.tracking.runs import CHECKOUT_TAG, OWNER_TAG

    checkout, other = tmp_path / "checkout", tmp_path / "elsewhere"
    (checkout / "clone").mkdir(parents=True)
    other.mkdir()
    killed = _killed_stage_run(checkout, "train")
    client = _client(mlflow_sqlite)
    run = client.get_run(killed)
    assert run.info.status == "RUNNING" and run.data.tags[CHECKOUT_TAG] == str(checkout)
    exp = run.info.experiment_id
    dead_owner = run.data.tags[OWNER_TAG]
    host, pid, start = dead_owner.split("/")
    assert host == socket.gethostname() and pid.isdigit() and start.isdigit()
    in_clone, elsewhere = (client.create_run(exp, tags={OWNER_TAG: dead_owner, CHECKOUT_TAG: str(path)})
                           .info.run_id for path in (checkout / "clone", other))
    left = {name: client.create_run(exp, tags={CHECKOUT_TAG: str(checkout), **tags}).info.run_id
            for name, tags in {"live": {OWNER_TAG: owner()},
                               "other host": {OWNER_TAG: f"not-{host}/{pid}/{start}"},
                               "reused pid": {OWNER_TAG: f"{host}/{os.getpid()}/1"},
                               "no owner": {}}.items()}

    ended = tracking.end_orphaned_runs(checkout)
    assert sorted(ended) == sorted([killed, in_clone, left["reused pid"]])  # a live pid that is not the owner
    for run_id in ended:
        run = client.get_run(run_id)
        assert run.info.status == "KILLED" and run.info.end_time is not None
    assert client.get_run(elsewhere).info.status == "RUNNING"
    assert {name: client.get_run(run_id).info.status for name, run_id in left.items()} == {
        "live": "RUNNING", "other host": "RUNNING", "reused pid": "KILLED", "no owner": "RUNNING"}
    assert tracking.end_orphaned_runs(checkout) == []  # nothing left to end
    assert tracking.end_orphaned_runs(other) == [elsewhere]


def _download_with_store(tmp_path: Path, store: Path) -> subprocess.CompletedProcess:
    """``python -m pipeline.download`` with tracking on against the SQLite store ``store`` (and no mirror: the
    stage would fail at its first download, after its MLflow run opened)."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(merged_profile("tiny", REPO)), encoding="utf-8")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NMT_")}, "NMT_TRACKING": "on",
           "MLFLOW_TRACKING_URI": f"sqlite:///{store}", "NMT_DATA_MIRROR": str(tmp_path / "no-mirror")}
    return subprocess.run([sys.executable, "-m", "pipeline.download", "--params", "params.yaml"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_corrupt_sqlite_store_is_one_line_naming_it_and_the_remedy(tmp_path: Path) -> None:
    """A store that is not a database was an 85-line SQLAlchemy traceback; the file is left as it was."""
    store = tmp_path / "mlflow.db"
    store.write_bytes(b"not a database, " * 4096)
    run = _download_with_store(tmp_path, store)
    assert (run.returncode, run.stderr) == (1, (
        f"error: stage download: {store}: the MLflow store is not a SQLite database (file is not a database): move "
        f"it aside (mv {store} {store}.corrupt) and rerun to start an empty store, or set MLFLOW_TRACKING_URI to "
        "another store\n"))
    assert store.read_bytes() == b"not a database, " * 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "params.yaml"]


def test_a_locked_sqlite_store_is_one_line_naming_it_and_the_remedy(tmp_path: Path) -> None:
    """Another process holding an exclusive transaction on the store: one line after a bounded wait."""
    store = tmp_path / "mlflow.db"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
        "c.execute('CREATE TABLE t (x)'); c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(120)"),
        str(store)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        run = _download_with_store(tmp_path, store)
    finally:
        holder.kill()
        holder.wait()
    assert (run.returncode, run.stderr) == (1, (
        f"error: stage download: {store}: the MLflow store stayed locked for 5 s (another process holds a write "
        f"transaction on it: fuser {store}); let it finish or end it, or set NMT_TRACKING=off to run without "
        "tracking\n"))
