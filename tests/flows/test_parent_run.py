"""What the MLflow parent run is called, which headline metrics it carries, and how a killed or resumed run's
MLflow run is ended or continued (a SQLite store)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.parent_run import end_orphans, pipeline_run, run_name
from flows.report import HEADLINE_METRICS, headline_from, headline_metrics
from pipeline.core.details import EvaluateDetails, TrainDetails
from pipeline.core.errors import DataError
from pipeline.tracking import child_run
from tests.helpers.paths import REPO

EVALUATE = EvaluateDetails.from_json({"valid": {"bleu": 25.5, "chrf2": 51.0, "ppl": 6.25, "signatures": {}},
                                     "test": {"bleu": 27.25, "chrf2": 55.5}, "chosen": {"beam": 4}}, "e.json")


def test_the_name_says_profile_commit_and_time() -> None:
    when = time.mktime((2026, 11, 25, 18, 40, 0, 0, 0, -1))
    assert run_name("demo", "291a2df0123456789", when) == "demo 11-25 18:40 291a2df"  # profile and time first
    assert run_name("tiny", "").endswith(" no-git")
    assert re.fullmatch(r"paper \d\d-\d\d \d\d:\d\d abcdef0", run_name("paper", "abcdef0123"))


def test_headline_metrics_on_gpu_and_cpu() -> None:
    gpu = headline_metrics(EVALUATE, TrainDetails(step=100000, wall_seconds=43200.0, world_size=8, device="cuda"))
    assert gpu == {"test_bleu": 27.25, "valid_bleu": 25.5, "test_chrf": 55.5, "valid_chrf": 51.0, "valid_ppl": 6.25,
                   "train_steps": 100000.0, "gpu_hours": 96.0}
    assert set(gpu) == set(HEADLINE_METRICS)
    cpu = headline_metrics(EVALUATE, TrainDetails(step=700, wall_seconds=534.8, world_size=1, device="cpu"))
    assert cpu["gpu_hours"] == 0.0 and cpu["train_steps"] == 700.0


def test_missing_files_and_figures_are_left_out(tmp_path: Path) -> None:
    assert headline_metrics(None, None) == {}
    (tmp_path / "evaluate.details.json").write_text('{"valid": {"ppl": null}, "test": {"bleu": 20}}')
    (tmp_path / "train.details.json").write_text('{"step": null}')
    assert headline_from(tmp_path) == {"test_bleu": 20.0}
    (tmp_path / "train.details.json").write_text('{"step": "n/a"}')  # a wrong type is named, not skipped
    with pytest.raises(DataError, match=r"train\.details\.json: step: expected an integer"):
        headline_from(tmp_path)


@pytest.mark.slow
def test_a_reopened_variant_run_is_continued_not_duplicated(tmp_path: Path, mlflow_sqlite: str) -> None:
    """A resumed sweep variant finds the run its interrupted try opened under the sweep's run and continues it."""
    from mlflow.tracking import MlflowClient

    from pipeline.core.owner import owner
    from pipeline.tracking.runs import OWNER_TAG

    client = MlflowClient(tracking_uri=mlflow_sqlite)
    with pipeline_run("sweep-x", params={}, root=tmp_path) as sweep:
        params = {"train.warmup_steps": 13, "model.d_model": 64}
        tags = {"mlflow.parentRunId": sweep.run_id, "sweep.variant": "x-2"}
        with pytest.raises(RuntimeError), pipeline_run("x-2", params=params, root=tmp_path, tags=tags):
            raise RuntimeError("killed")  # the interrupted try: its run ends FAILED
        with pipeline_run("x-1", params=params, root=tmp_path, tags={**tags, "sweep.variant": "x-1"}):
            pass
        earlier = child_run(sweep.run_id, "sweep.variant", "x-2", tmp_path)
        assert client.get_run(earlier).info.status == "FAILED"
        with pipeline_run("x-2", params=params, root=tmp_path, tags=tags, reopen=earlier) as again:
            assert again.run_id == earlier and client.get_run(earlier).info.status == "RUNNING"
        assert child_run(sweep.run_id, "sweep.variant", "x-3", tmp_path) is None
    children = client.search_runs([client.get_run(earlier).info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{sweep.run_id}'")
    assert sorted(r.data.tags["sweep.variant"] for r in children) == ["x-1", "x-2"]  # one run per variant
    run = client.get_run(earlier)
    assert run.info.status == "FINISHED" and run.data.params == {"model.d_model": "64", "train.warmup_steps": "13"}
    assert run.data.tags[OWNER_TAG] == owner()
    with pipeline_run("x-4", params={}, root=tmp_path, reopen="0" * 32) as new:  # gone: a new run instead
        assert new.run_id != "0" * 32


@pytest.mark.slow
def test_a_killed_flows_parent_run_is_ended_when_the_next_run_starts(tmp_path: Path, mlflow_sqlite: str) -> None:
    from mlflow.tracking import MlflowClient

    script = ("import os, signal, sys; from flows.parent_run import pipeline_run\n"
              "with pipeline_run('tiny abc 2026', params={'a': 1}, root=sys.argv[1]) as run:\n"
              "    print(run.run_id, flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          check=False, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    run_id = done.stdout.strip()
    client = MlflowClient(tracking_uri=mlflow_sqlite)
    assert client.get_run(run_id).info.status == "RUNNING"
    end_orphans(tmp_path)
    assert client.get_run(run_id).info.status == "KILLED"


@pytest.mark.slow
def test_run_links_on_a_server_open_the_training_view_and_mlflows_own_are_not_printed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """MLflow's client prints `#/experiments/<id>/runs/<run_id>` when a run on a server ends, a page its UI opens
    on the GenAI view; ours carry workflowType=machine_learning and MLflow's are not printed."""
    import socket
    import urllib.request

    from mlflow.tracking import MlflowClient

    from flows.report import render_report
    from pipeline import tracking

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1",
                               "--port", str(port), "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                               "--default-artifact-root", str(tmp_path / "artifacts")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2).close()  # noqa: S310
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "mlflow server did not start"
                time.sleep(1)
        monkeypatch.setenv("NMT_TRACKING", "on")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "")  # restored (unset) after the test
        monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")
        bare = MlflowClient(tracking_uri=uri)  # what MLflow does by itself
        exp = bare.create_experiment("bare")
        bare.set_terminated(bare.create_run(exp).info.run_id)
        assert f"{uri}/#/experiments/{exp}/runs/" in capsys.readouterr().out  # MLflow's own link, no view in it
        caplog.set_level("INFO", logger="pipeline.tracking")
        with tracking.stage_run("audit", root=tmp_path) as run:
            run.open()
        experiment = MlflowClient(tracking_uri=uri).get_run(run.run_id).info.experiment_id
        page = f"{uri}/#/experiments/{experiment}/runs/{run.run_id}?workflowType=machine_learning"
        assert "View run" not in capsys.readouterr().out
        assert f"MLflow run {run.run_id} (FINISHED): {page}" in caplog.text
        assert tracking.ui_page(run.run_id, tmp_path) == page
        report = render_report([], bleu=None, mlflow_run_id=run.run_id, tracking_uri=uri, git={}, ui_page=page)
        assert f"- MLflow parent run: [{run.run_id}]({page})" in report
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
