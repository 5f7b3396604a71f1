"""The Prefect flow against a real Prefect API (test harness) and real ``dvc repro`` in a temp git repo.

The toy dvc.yaml has its own tiny stages (``toy.py`` in tests/helpers/toyflow.py), never the ML stages:
what is under test is the sequencing, status parsing, retries, failures, timeouts, process-group
killing and the report.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows import lifeline
from flows.dvc_task import dvc_stages, stage_status
from flows.lifeline import run_in_group
from flows.pipeline import ARTIFACT_KEY, StageFailed, wmt14_pipeline
from flows.report import HEADLINE_METRICS
from pipeline.core.errors import EXIT_PERMANENT, PipelineError
from pipeline.project.profiles import active_profile, merged_profile
from tests.helpers.paths import REPO
from tests.helpers.repoutil import git as _git
from tests.helpers.toyflow import PIPELINE, MakeRepo, wait_dead

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]


def _artifact(flow_run_id: object) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT_KEY])),
                                     flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    assert len(arts) == 1
    return str(arts[0].data)


def test_status_parsing_matches_dvc_messages() -> None:
    assert stage_status("a", ["Running stage 'a':", "> python x"]) == "ran"
    assert stage_status("a", ["Stage 'a' didn't change, skipping"]) == "skipped"
    assert stage_status("a", ["Stage 'a' is cached - skipping run, checking out outputs"]) == "restored"
    assert stage_status("a", ["Restored stage 'a' from run-cache"]) == "restored"
    assert stage_status("a", ["Running stage 'ab':"]) == "unknown"


def test_group_runner_collapses_progress_and_reaps_leftover_members(tmp_path: Path) -> None:
    script = ("import subprocess, sys; p = subprocess.Popen(['sleep', '60']); print(p.pid); "
              "sys.stdout.write('10%\\r50%\\r100%\\n'); print('oops', file=sys.stderr)")
    result = run_in_group([sys.executable, "-c", script], cwd=tmp_path, grace_s=2)
    assert result.returncode == 0
    child = int(result.stdout_lines[0])
    assert result.stdout_lines[1:] == ("100%",) and result.stderr_tail == ("oops",)
    assert wait_dead([child]) == []  # the leader exited cleanly; its leftover child is ended too
    assert lifeline._live_groups == set()  # noqa: SLF001 - no group is left registered


def test_a_stage_line_is_logged_once_at_its_level_without_its_prefix_or_colour_codes(tmp_path: Path, caplog) -> None:
    script = ("import sys; print('12:00:01 WARNING pipeline.clean: 3 pairs dropped'); "
              "print('12:00:02 INFO pipeline.clean: done'); print('\\x1b[33mplain\\x1b[0m line', file=sys.stderr)")
    caplog.set_level(logging.INFO, logger="flows.test")
    result = run_in_group([sys.executable, "-c", script], cwd=tmp_path, grace_s=2,
                          logger=logging.getLogger("flows.test"))
    assert result.returncode == 0
    got = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "flows.test"]
    assert sorted(got) == [("INFO", "pipeline.clean: done"), ("INFO", "plain line"),
                           ("WARNING", "pipeline.clean: 3 pairs dropped")]


def test_runs_then_skips_then_restores_with_report(make_repo: MakeRepo) -> None:
    repo = make_repo(PIPELINE)
    state = wmt14_pipeline(repo=str(repo), profile="tiny", return_state=True)
    first = state.result()
    assert [(s["stage"], s["status"]) for s in first["stages"]] == [("prep", "ran"), ("build", "ran"),
                                                                    ("score", "ran")]
    assert (repo / "build.txt").read_text() == "xx"
    tiny_metrics = repo / merged_profile("tiny", repo)["paths"]["metrics"]
    assert (tiny_metrics / "evaluate.details.json").is_file()  # the stages read the tiny profile...
    assert active_profile(repo) == "tiny"  # ...which the workspace keeps, as after `nmt profile tiny`
    status = subprocess.run(["dvc", "status"], cwd=repo, capture_output=True, text=True, check=True).stdout
    assert "up to date" in status, status  # params.yaml and dvc.lock describe the workspace together
    md = _artifact(state.state_details.flow_run_id)
    assert md == first["markdown"]
    assert "| prep | ran |" in md and "| score | ran |" in md
    assert "| test | bleu | 27.31 | `nrefs:1|case:mixed" not in md  # pipes in cells are escaped
    assert "| test | bleu | 27.31 |" in md and "| valid | chrf | 50.00 |" in md and "Beam 4, alpha 0.6" in md
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                            check=True).stdout.strip()
    assert first["git_commit"] == commit and f"`{commit}`" in md
    assert "tracking off" in md

    # any order in, pipeline order out
    second = wmt14_pipeline(repo=str(repo), stages=["score", "prep"], profile="tiny")
    assert [(s["stage"], s["status"]) for s in second["stages"]] == [("prep", "skipped"), ("score", "skipped")]

    (repo / "build.txt").unlink()
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    del lock["stages"]["build"]
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock))
    third = wmt14_pipeline(repo=str(repo), stages=["build"], profile="tiny")
    assert third["stages"][0]["status"] == "restored"  # DVC's run cache, not Prefect's
    forced = wmt14_pipeline(repo=str(repo), stages=["build"], force=True, profile="tiny")
    assert forced["stages"][0]["status"] == "ran"


def test_a_run_pushes_what_it_built_and_a_fresh_clone_restores_every_stage(make_repo: MakeRepo,
                                                                          tmp_path: Path) -> None:
    """The flow ends by ``dvc push --run-cache`` to the default remote; a clone of the same commit without the
    dvc.lock (a scheduled run never commits it) restores every stage through the run cache and runs none."""
    repo = make_repo(PIPELINE)
    remote = tmp_path / "dvc-remote"
    subprocess.run(["dvc", "remote", "add", "-d", "store", str(remote)], cwd=repo, check=True)
    _git(repo, "commit", "-qam", "a remote")
    assert wmt14_pipeline(repo=str(repo), profile="tiny", push=False)["stages"][0]["status"] == "ran"
    assert not remote.exists()  # --no-push
    wmt14_pipeline(repo=str(repo), profile="tiny")
    assert (remote / "runs").is_dir() and (remote / "files" / "md5").is_dir()
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    report = wmt14_pipeline(repo=str(clone), profile="tiny", push=False)
    assert [s["status"] for s in report["stages"]] == ["restored"] * 3
    assert (clone / "build.txt").read_text() == "xx"


def test_unknown_stage_is_named(make_repo: MakeRepo) -> None:
    repo = make_repo(PIPELINE)
    assert dvc_stages(repo) == ["prep", "build", "score"]
    with pytest.raises(PipelineError, match=r"no stage 'trian'; known: prep, build, score"):
        wmt14_pipeline(repo=str(repo), stages=["trian"])


def test_transient_failure_succeeds_on_retry(make_repo: MakeRepo) -> None:
    stages = {"flaky": {"cmd": "python toy.py flaky marker.txt out.txt", "deps": ["toy.py"], "outs": ["out.txt"]}}
    repo = make_repo(stages)
    out = wmt14_pipeline(repo=str(repo), retries={"flaky": 1}, retry_delay_s={"flaky": 0})
    assert out["stages"] == [{"stage": "flaky", "status": "ran", "duration_s": out["stages"][0]["duration_s"],
                              "attempts": 2}]
    assert (repo / "out.txt").read_text() == "ok"


def test_permanent_failure_names_stage_exit_code_and_stderr_tail(make_repo: MakeRepo) -> None:
    stages = {"prep": PIPELINE["prep"],
              "broken": {"cmd": "python toy.py fail", "deps": ["prep.txt"], "outs": ["never.txt"]},
              "after": {"cmd": "python toy.py write after.txt never.txt", "deps": ["never.txt"],
                        "outs": ["after.txt"]}}
    repo = make_repo(stages)
    state = wmt14_pipeline(repo=str(repo), profile="demo", return_state=True)
    assert state.is_failed()
    assert active_profile(repo) == "demo"  # a failed profile run leaves the workspace switched, as a finished one
    with pytest.raises(StageFailed) as info:
        state.result()
    msg = str(info.value)
    assert "stage 'broken' failed with exit code" in msg and info.value.returncode != 0
    assert "err line 29" in msg and "err line 12" in msg and "err line 9\n" not in msg  # the last ~20 lines
    assert "exited with 7" in msg  # DVC's own error line carries the command's exit code
    assert not (repo / "after.txt").exists()  # later stages never ran
    md = _artifact(state.state_details.flow_run_id)
    assert "| prep | ran |" in md and "| broken | failed (exit " in md and "after" not in md.split("## BLEU")[0]


def test_a_permanent_stage_failure_is_not_retried(repo_root: Path, make_repo: MakeRepo) -> None:
    """A stage exiting with EXIT_PERMANENT (a DNS failure, a 404) runs once whatever its retries; its one line is
    the flow's error, with no traceback (a DNS failure offline took 4 attempts, 3 minutes and 115 lines)."""
    line = "error: stage fetch: http://nonexistent.invalid/x: host not found; set NMT_DATA_MIRROR"
    stages = {"fetch": {"cmd": f"echo run >> runs.txt && echo '{line}' >&2 && exit {EXIT_PERMANENT}",
                        "deps": ["toy.py"], "outs": ["fetched.txt"]}}
    repo = make_repo(stages)
    with pytest.raises(StageFailed) as info:
        wmt14_pipeline(repo=str(repo), retries={"fetch": 2}, retry_delay_s={"fetch": 0})
    assert str(info.value) == f"stage 'fetch' failed (exit {EXIT_PERMANENT}, not retried): {line[7:]}"
    assert (repo / "runs.txt").read_text() == "run\n"
    flow = subprocess.run([sys.executable, "-m", "flows.pipeline", "--repo", str(repo)], cwd=repo_root,
                          env={**os.environ, "PYTHONPATH": str(repo_root)}, capture_output=True, text=True,
                          timeout=120, check=False)
    assert flow.returncode == 1 and "Traceback" not in flow.stdout + flow.stderr, flow.stderr[-3000:]
    assert flow.stderr.strip().splitlines()[-1] == f"error: {info.value}"


def test_timeout_kills_the_whole_process_group(make_repo: MakeRepo) -> None:
    stages = {"hang": {"cmd": "python toy.py spawn pids.txt", "deps": ["toy.py"], "outs": ["never.txt"]}}
    repo = make_repo(stages)
    started = time.monotonic()
    with pytest.raises(StageFailed, match=r"stage 'hang' timed out after \d+ s \(process group killed\)"):
        wmt14_pipeline(repo=str(repo), timeouts_s={"hang": 4}, kill_grace_s=2)
    assert time.monotonic() - started < 30
    child, stage_pid = map(int, (repo / "pids.txt").read_text().split())
    assert wait_dead([child, stage_pid]) == []


def test_sigterm_to_the_flow_process_ends_the_stage_group(repo_root: Path, make_repo: MakeRepo) -> None:
    from prefect.settings import PREFECT_API_URL

    stages = {"hang": {"cmd": "python toy.py spawn pids.txt", "deps": ["toy.py"], "outs": ["never.txt"]}}
    repo = make_repo(stages)
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PYTHONPATH": str(repo_root)}
    proc = subprocess.Popen([sys.executable, "-m", "flows.pipeline", "--repo", str(repo), "--kill-grace", "3"],
                            cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (repo / "pids.txt").exists():
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "stage never started"
            time.sleep(0.2)
        child, stage_pid = map(int, (repo / "pids.txt").read_text().split())
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode != 0, output
        assert wait_dead([child, stage_pid]) == [], output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_tracking_links_parent_child_and_tags_lock_md5(make_repo: MakeRepo, mlflow_sqlite: str) -> None:
    from mlflow.tracking import MlflowClient

    from pipeline.core.stages import lock_md5

    stages = {"tracked": {"cmd": "python toy.py track out.txt", "deps": ["toy.py"], "outs": ["out.txt"]}}
    repo = make_repo(stages)
    state = wmt14_pipeline(repo=str(repo), return_state=True)
    out = state.result()
    client = MlflowClient(tracking_uri=mlflow_sqlite)
    parent = client.get_run(out["mlflow_run_id"])
    metrics = json.loads((repo / "metrics" / "paper" / "tracked.details.json").read_text())
    child = client.get_run(metrics["mlflow_run_id"])
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    flow_run_id = str(state.state_details.flow_run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.data.tags["dvc_lock_md5"] == lock_md5(lock, "tracked")
    assert child.data.tags["seen_flow_run_id"] == flow_run_id  # reached the stage through its env
    assert parent.data.tags["prefect.flow_run_id"] == flow_run_id
    assert parent.data.tags["produced_by.tracked"] == child.info.run_id
    assert "MLFLOW_PARENT_RUN_ID" not in os.environ  # only the subprocess saw it
    assert f"`{parent.info.run_id}`" in out["markdown"]
    # A second pipeline run: DVC skips the stage, the new parent still points at the run that produced it.
    again = client.get_run(wmt14_pipeline(repo=str(repo))["mlflow_run_id"])
    assert again.info.run_id != parent.info.run_id and again.data.tags["produced_by.tracked"] == child.info.run_id


def test_a_profile_run_is_clean_tagged_named_and_carries_the_headline_metrics(make_repo: MakeRepo,
                                                                              mlflow_sqlite: str) -> None:
    from mlflow.tracking import MlflowClient

    repo = make_repo({"tracked": {"cmd": "python toy.py track out.txt", "deps": ["toy.py"], "outs": ["out.txt"]},
                      "score": {"cmd": "python toy.py bleu score.txt", "deps": ["toy.py"], "outs": ["score.txt"]}})
    (repo / "notes.txt").write_text("a\n")
    _git(repo, "add", "notes.txt")
    _git(repo, "commit", "-qm", "notes")
    head = _git(repo, "rev-parse", "HEAD")
    client = MlflowClient(tracking_uri=mlflow_sqlite)
    first = wmt14_pipeline(repo=str(repo), profile="tiny")
    parent = client.get_run(first["mlflow_run_id"])
    # MLflow 3.17's UI opens an experiment on its GenAI overview unless the URL asks for the training runs
    page = f"http://127.0.0.1:5000/#/experiments/{parent.info.experiment_id}?workflowType=machine_learning"
    assert f"--host 127.0.0.1` (then {page})" in first["markdown"]
    assert re.fullmatch(rf"tiny \d\d-\d\d \d\d:\d\d {head[:7]}", parent.info.run_name)
    child = client.get_run(parent.data.tags["produced_by.tracked"])
    for run in (parent, child):  # params.yaml holds the tiny profile rendered from the commit's profiles/
        assert run.data.tags["profile"] == "tiny" and run.data.tags["git_dirty"] == "false", run.data.tags
    assert parent.data.metrics == {"test_bleu": 27.31, "valid_bleu": 25.25}  # the toy's evaluate: no chrF, no train
    assert set(parent.data.metrics) <= set(HEADLINE_METRICS)

    (repo / "notes.txt").write_text("b\n")  # a real uncommitted change
    again = wmt14_pipeline(repo=str(repo), profile="tiny")
    assert {s["status"] for s in again["stages"]} == {"skipped"}
    second = client.get_run(again["mlflow_run_id"])
    assert second.data.tags["git_dirty"] == "true"
    assert second.data.metrics == parent.data.metrics  # read from the details files DVC kept, not from the stages


def test_an_unknown_stage_is_refused_before_any_mlflow_run(repo_root: Path, make_repo: MakeRepo,
                                                          mlflow_sqlite: str) -> None:
    repo = make_repo(PIPELINE)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # refused before a server would start
    env["PYTHONPATH"] = str(repo_root)
    flow = subprocess.run([sys.executable, "-m", "flows.pipeline", "--repo", str(repo), "--stages", "bogus"],
                          cwd=repo_root, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert flow.returncode == 1, flow.stdout + flow.stderr
    assert flow.stderr.strip().splitlines() == [f"error: {repo}/dvc.yaml: no stage 'bogus'; known: prep, build, score"]
    nmt = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "--profile", "tiny", "bogus"], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=120, check=False)
    assert nmt.returncode == 1, nmt.stdout + nmt.stderr
    assert nmt.stderr.strip().splitlines() == ["error: no stage 'bogus'; known stages: download, clean, bpe, encode, "
                                               "train, average, evaluate, register, audit"]
    db = Path(mlflow_sqlite[len("sqlite:///"):])
    assert not db.exists() and not (repo / ".mlflow").exists()  # no store, so no run in it
    assert _git(repo, "status", "--porcelain") == ""  # nor params.yaml, nor anything else touched


def test_a_prefect_api_url_with_nothing_listening_is_one_line_before_anything_runs(
        repo_root: Path, make_repo: MakeRepo, mlflow_sqlite: str) -> None:
    """``PREFECT_API_URL`` naming a port where nothing listens ended the flow (what ``nmt run`` runs) in 110 lines
    of Prefect's connection retries and traceback."""
    repo = make_repo(PIPELINE)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/api"  # bound, never listening: refused at once
        env = {**os.environ, "PREFECT_API_URL": url, "PYTHONPATH": str(repo_root)}
        nmt = subprocess.run([sys.executable, "-m", "flows.pipeline", "--repo", str(repo), "--stages", "prep"],
                             cwd=repo, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert (nmt.returncode, nmt.stdout) == (1, ""), nmt.stderr
    assert nmt.stderr == (f"error: PREFECT_API_URL={url}: no Prefect server answers there ({url}/health); start it "
                          "(prefect server start) or unset PREFECT_API_URL, and the run starts a temporary server of "
                          "its own\n")
    assert not Path(mlflow_sqlite[len("sqlite:///"):]).exists() and not (repo / "prep.txt").exists()
    assert _git(repo, "status", "--porcelain") == ""


def test_a_failing_stage_fails_the_parent_run(make_repo: MakeRepo, mlflow_sqlite: str) -> None:
    from mlflow.tracking import MlflowClient

    repo = make_repo({"broken": {"cmd": "python toy.py fail", "deps": ["toy.py"], "outs": ["never.txt"]}})
    state = wmt14_pipeline(repo=str(repo), return_state=True)
    assert state.is_failed()
    client = MlflowClient(tracking_uri=mlflow_sqlite)
    parents = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
               if r.data.tags.get("pipeline") == "true"]
    assert [p.info.status for p in parents] == ["FAILED"]


def test_nmt_run_is_the_flow(make_repo: MakeRepo) -> None:
    """``nmt run`` runs this flow (the one whole-pipeline runner) in a subprocess; tracking off leaves no store."""
    from prefect.settings import PREFECT_API_URL

    repo = make_repo(PIPELINE)
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    nmt = [sys.executable, "-m", "pipeline.cli", "run"]
    done = subprocess.run([*nmt, "--force"], cwd=repo, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert all(f"| {stage} | ran |" in done.stdout for stage in PIPELINE), done.stdout  # the flow's report
    assert (repo / "build.txt").read_text() == "xx" and not (repo / ".mlflow").exists()
    bad = subprocess.run([*nmt, "bogus"], cwd=repo, env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert bad.returncode == 1 and bad.stderr.strip().endswith("error: no stage 'bogus'; known stages: download, "
                                                               "clean, bpe, encode, train, average, evaluate, "
                                                               "register, audit")


def test_prefect_deploy_registers_prefect_yaml_at_its_commit_and_its_pull_steps_work(
        tmp_path: Path, make_repo: MakeRepo, repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefect deploy --all`` (Prefect's own CLI, no wrapper of ours) registers the deployment as prefect.yaml
    defines it, pinned to the commit it ran at; what a worker then does (clone at that commit, cd into it) and the
    flow's stage tasks (``dvc repro --pull``, after the profile is chosen) restore the outputs from the DVC remote."""
    from prefect.client.orchestration import get_client
    from prefect.deployments.steps.core import run_steps
    from prefect.settings import PREFECT_API_URL
    from prefect.utilities.asyncutils import run_coro_as_sync

    repo = make_repo(PIPELINE)
    shutil.copytree(repo_root / "flows", repo / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(repo_root / "prefect.yaml", repo / "prefect.yaml")
    subprocess.run(["dvc", "remote", "add", "-d", "store", str(tmp_path / "dvc-remote")], cwd=repo, check=True)
    subprocess.run(["dvc", "repro", "-q"], cwd=repo, check=True)
    subprocess.run(["dvc", "push", "-q"], cwd=repo, check=True)
    _git(repo, "remote", "add", "origin", str(repo))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "deploy me")
    commit = _git(repo, "rev-parse", "HEAD")
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    prefect = str(Path(sys.executable).with_name("prefect"))
    subprocess.run([prefect, "work-pool", "create", "gpu-pool", "--type", "process", "--overwrite"], cwd=repo,
                   env=env, check=True, capture_output=True)
    done = subprocess.run([prefect, "--no-prompt", "deploy", "--all"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("wmt14-pipeline/paper-weekly")
    spec = next(d for d in yaml.safe_load((repo_root / "prefect.yaml").read_text())["deployments"]
                if d["name"] == "paper-weekly")
    clone = dep.pull_steps[0]["prefect.deployments.steps.git_clone"]
    assert (clone["repository"], clone["commit_sha"]) == (str(repo), commit)
    assert [next(iter(step)) for step in dep.pull_steps] == [  # no `dvc pull` before the flow chooses its profile
        "prefect.deployments.steps.git_clone", "prefect.deployments.steps.set_working_directory",
        "prefect.deployments.steps.run_shell_script"]  # the last: the worker's environment names the MLflow server
    assert [(s.schedule.cron, s.schedule.timezone) for s in dep.schedules] == [("0 2 * * 6", "UTC")]
    assert dep.global_concurrency_limit.limit == 1 and dep.concurrency_options.collision_strategy.value == "ENQUEUE"
    assert dep.work_pool_name == spec["work_pool"]["name"] == "gpu-pool"
    assert dep.entrypoint == spec["entrypoint"] == "flows.pipeline:wmt14_pipeline"
    assert dep.parameters == spec["parameters"] and sorted(dep.tags) == sorted(spec["tags"])
    assert dep.job_variables == spec["work_pool"]["job_variables"]

    work = tmp_path / "worker"  # what a worker does before the flow
    work.mkdir()
    monkeypatch.chdir(work)
    outputs = run_coro_as_sync(run_steps(dep.pull_steps))
    cloned = Path(outputs["directory"])
    assert cloned.parent == work and Path.cwd() == cloned
    assert _git(cloned, "rev-parse", "HEAD") == commit and not (cloned / "build.txt").exists()
    report = wmt14_pipeline(repo=str(cloned), push=False)
    assert [(s["stage"], s["status"]) for s in report["stages"]] == [
        ("prep", "restored"), ("build", "restored"), ("score", "restored")]
    assert (cloned / "build.txt").read_text() == "xx"  # fetched from the DVC remote, not rebuilt


def test_an_unreachable_tracking_server_is_refused_before_any_prefect_server(tmp_path: Path) -> None:
    """One line within seconds (MLflow's own retries took minutes and a 109-line traceback); nothing started."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "NMT_TRACKING": "on", "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}",
           "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flows.pipeline", "--repo", str(REPO)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and time.monotonic() - start < 30
    assert proc.stderr.strip().splitlines() == [
        f"error: MLFLOW_TRACKING_URI=http://127.0.0.1:{port}: no tracking server answers (Failed to establish a new "
        "connection: [Errno 111] Connection refused); start it or set MLFLOW_TRACKING_URI to a running server, or "
        "set NMT_TRACKING=off to run without tracking"]
    assert "temporary Prefect server" not in proc.stdout + proc.stderr


def test_a_prefect_home_no_one_can_write_is_one_line_naming_it_and_the_cause(tmp_path: Path) -> None:
    """The temporary server exits at once when SQLite cannot create its database under PREFECT_HOME: the line names
    PREFECT_HOME and SQLite's cause, not a startup timeout to raise. /proc/self/fdinfo is a folder that exists and
    that no user can create a file in, root included (chmod does not stop root)."""
    env = {**os.environ, "NMT_TRACKING": "off", "PREFECT_HOME": "/proc/self/fdinfo", "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([sys.executable, "-m", "flows.pipeline", "--repo", str(REPO), "--stages", "download"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert re.fullmatch(
        r"error: temporary Prefect server on http://127\.0\.0\.1:\d+/api exited with code \d+: it cannot write its "
        r"database under PREFECT_HOME=/proc/self/fdinfo \[sqlalchemy\.exc\.OperationalError: "
        r"\(sqlite3\.OperationalError\) unable to open database file\]; set PREFECT_HOME to a writable folder "
        r"\(the Makefile uses \.prefect in the checkout\), or PREFECT_API_URL to a running server", line), line
    assert not list(tmp_path.iterdir())
