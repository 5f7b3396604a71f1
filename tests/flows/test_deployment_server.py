"""The deployment against a real ``prefect server start``: the scheduler fills a cron schedule, a real
``prefect worker start --run-once`` on the process pool clones the deployed commit and runs ``wmt14-pipeline`` to
completion, its stage task restoring from the DVC remote (``dvc repro --pull``) and the run pushing at the end.

The first test's deployed repository is a toy one (this checkout's ``flows/``, ``pipeline/`` and ``profiles/``
with a one-stage dvc.yaml and a local DVC remote); the second deploys the real pipeline on the tiny profile
(tests/helpers/tinyproject.py) with this checkout's ``.dvc/config`` (its default remote under ``$HOME``, a temporary
folder here) and runs it twice. Both are registered with Prefect's own ``prefect deploy --all`` from this
checkout's ``prefect.yaml`` with the test's schedule, parameters and job environment.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.pipeline import ARTIFACT_KEY, FLOW_NAME
from tests.helpers.mirror import write_multi30k_mirror
from tests.helpers.paths import REPO
from tests.helpers.prefect_server import prefect_server, stop_group
from tests.helpers.tinyproject import built_env, make_tiny_project

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
DEPLOYMENT = "every-minute"
POOL = "gpu-pool"  # prefect.yaml's work pool
STAGES = {"hello": {"cmd": "python -c \"open('hello.txt', 'w').write('hi')\"", "outs": ["hello.txt"]}}


@dataclass(frozen=True)
class Server:
    """A running Prefect server: its API URL and the environment its clients use."""

    url: str
    env: dict[str, str]
    log: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``prefect server start`` on a free loopback port with its own PREFECT_HOME; always stopped."""
    settings = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1", "NMT_TRACKING": "off",
                "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    with prefect_server(tmp_path_factory.mktemp("prefect-server"), settings, str(BIN / "prefect")) as (env, log):
        yield Server(url=env["PREFECT_API_URL"], env=env, log=log)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _toy_repository(dest: Path, remote: Path) -> str:
    """A committed git + DVC repo with the flow code, one stage pushed to a local remote and prefect.yaml's
    deployment every minute under the name ``every-minute``, its own ``origin``; its commit."""
    dest.mkdir(parents=True)
    for folder in ("flows", "pipeline", "profiles"):
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "profiles" / "paper.yaml", dest / "params.yaml")
    (dest / "dvc.yaml").write_text(yaml.safe_dump({"stages": STAGES}, sort_keys=False))
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())
    spec = deployments["deployments"][0]
    spec.update(name=DEPLOYMENT, schedules=[{"cron": "* * * * *"}])
    spec["work_pool"]["job_variables"]["env"].update(MLFLOW_TRACKING_URI="", NMT_NPROC="1")
    (dest / "prefect.yaml").write_text(yaml.safe_dump(deployments, sort_keys=False))
    _git(dest, "init", "-q")
    _git(dest, "remote", "add", "origin", str(dest))
    _git(dest, "config", "user.email", "t@example.com")
    _git(dest, "config", "user.name", "test")
    for args in (["init", "-q"], ["config", "core.check_update", "false"], ["remote", "add", "-d", "store", str(remote)],
                 ["repro", "-q"], ["push", "-q"]):
        subprocess.run([str(BIN / "dvc"), *args], cwd=dest, check=True, capture_output=True)
    _git(dest, "add", "-A")
    _git(dest, "commit", "-qm", "toy pipeline, pushed to the DVC remote")
    return _git(dest, "rev-parse", "HEAD")


@contextlib.contextmanager
def _client(server: Server) -> Iterator[Any]:
    """A sync Prefect client for this server (whatever API another fixture may have set in-process)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: server.url}), get_client(sync_client=True) as client:
        yield client


def _deploy(server: Server, repo: Path, name: str = DEPLOYMENT) -> Any:
    """``prefect deploy --all`` in ``repo`` (its work pool created first, as docs/cluster.md says); the deployment."""
    subprocess.run([str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "process", "--overwrite"], cwd=repo,
                   env=server.env, check=True, capture_output=True)
    done = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all"], cwd=repo, env=server.env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    with _client(server) as client:
        return client.read_deployment_by_name(f"{FLOW_NAME}/{name}")


def _runs(server: Server, deployment_id: Any) -> list[Any]:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with _client(server) as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                                     sort=FlowRunSort.EXPECTED_START_TIME_ASC)


def test_scheduler_fills_the_cron_schedule_and_a_worker_runs_a_scheduled_run(server: Server,
                                                                              tmp_path: Path) -> None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
    from prefect.states import Scheduled

    started, deployed_at = time.monotonic(), datetime.now(UTC)
    commit = _toy_repository(tmp_path / "toy", tmp_path / "dvc-remote")
    dep = _deploy(server, tmp_path / "toy")
    assert dep.work_pool_name == POOL and [s.schedule.cron for s in dep.schedules] == ["* * * * *"]
    assert dep.pull_steps[0]["prefect.deployments.steps.git_clone"]["commit_sha"] == commit

    # The scheduler service (loop 1 s here, 60 s by default) creates the upcoming runs by itself.
    deadline = time.monotonic() + 60
    while len(scheduled := [r for r in _runs(server, dep.id) if r.auto_scheduled]) < 2:
        assert time.monotonic() < deadline, f"no scheduled runs after 60 s:\n{server.log.read_text()[-3000:]}"
        time.sleep(0.5)
    times = [r.expected_start_time for r in scheduled]
    assert all(r.state.is_scheduled() for r in scheduled)
    assert all(t.second == 0 and t.microsecond == 0 for t in times) and len(set(times)) == len(times)
    assert times[0] >= deployed_at.replace(second=0, microsecond=0)

    # The worker takes the first scheduled run: when it is due within 20 s, wait for it; otherwise move
    # it to now rather than wait up to a minute. Either way the next one is 40+ s away: not due yet.
    chosen = scheduled[0]
    wait_s = (chosen.expected_start_time - datetime.now(UTC)).total_seconds()
    if wait_s < 20:
        time.sleep(max(wait_s, 0) + 0.5)
    else:
        with _client(server) as client:
            client.set_flow_run_state(chosen.id, Scheduled(scheduled_time=datetime.now(UTC)), force=True)
    work = tmp_path / "worker"
    work.mkdir()
    worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process",
                               "--run-once", "--prefetch-seconds", "0"], cwd=work, env=server.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output = worker.communicate(timeout=150)[0].decode(errors="replace")
    finally:
        stop_group(worker, grace_s=5)
    assert worker.returncode == 0, output[-4000:]

    runs = {r.id: r for r in _runs(server, dep.id)}
    assert runs[chosen.id].state.is_completed(), f"{runs[chosen.id].state}\n{output[-4000:]}"
    later = [r for r in runs.values()  # the chosen run keeps its expected start time when moved to now
             if r.id != chosen.id and r.auto_scheduled and r.expected_start_time > datetime.now(UTC)]
    assert later and all(r.state.is_scheduled() for r in later), [  # --run-once took only what was due
        (r.id, r.expected_start_time, r.state) for r in later]
    with _client(server) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT_KEY])),
                                     flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[chosen.id])))
    assert len(arts) == 1
    report = str(arts[0].data)
    assert "| hello | restored |" in report  # the stage task's dvc repro --pull fetched hello.txt from the remote
    assert f"`{commit}`" in report  # the worker ran the deployed commit
    print(f"\ndeployment test: {time.monotonic() - started:.0f} s after the server was healthy")


def _tiny_repository(root: Path) -> Path:
    """The tiny project with ``flows/``, this checkout's ``.dvc/config``, the paper profile as params.yaml (as in
    this checkout) and its ``prefect.yaml`` (deployment ``tiny``: no schedule, profile tiny), committed, its own
    ``origin``."""
    repo = make_tiny_project(root / "tiny")
    shutil.copy(REPO / "profiles" / "paper.yaml", repo / "params.yaml")  # the run chooses tiny before it pulls
    shutil.copytree(REPO / "flows", repo / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".dvc" / "config", repo / ".dvc" / "config")
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())
    spec = deployments["deployments"][0]
    spec.update(name="tiny", schedules=[])
    spec["parameters"]["profile"] = "tiny"
    (repo / "prefect.yaml").write_text(yaml.safe_dump(deployments, sort_keys=False))
    _git(repo, "remote", "add", "origin", str(repo))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "tiny pipeline, deployed")
    return repo


def _run_once(server: Server, dep: Any, work: Path, env: dict[str, str]) -> dict[str, str]:
    """One run of ``dep`` created now and taken by ``prefect worker start --run-once`` (its fresh temporary clone
    under ``work``); its stages' statuses from the run's report artifact."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    with _client(server) as client:
        run = client.create_flow_run_from_deployment(dep.id)
    work.mkdir()
    worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process",
                               "--run-once", "--prefetch-seconds", "0"], cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output = worker.communicate(timeout=900)[0].decode(errors="replace")
    finally:
        stop_group(worker, grace_s=5)
    with _client(server) as client:
        state = client.read_flow_run(run.id).state
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT_KEY])),
                                     flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    assert worker.returncode == 0 and state.is_completed(), f"{state}\n{output[-4000:]}"
    assert len(arts) == 1, output[-4000:]
    table = str(arts[0].data).split("## Stages")[1].split("## BLEU")[0]
    return dict(re.findall(r"^\| (\w+) \| (\w[\w ()]*?) \| [\d.]+ s \|", table, re.MULTILINE))


def test_the_tiny_deployment_run_twice_restores_every_stage_and_the_remote_holds_model_and_audit(
        server: Server, tmp_path: Path) -> None:
    """Issue 56's acceptance: two runs of the real flow (tiny profile) by a process worker, each in its own fresh
    clone; the first builds and pushes (the committed default remote, under ``$HOME``), the second runs no stage
    command, and the remote holds the averaged model and the audit (by the md5s its run cache records)."""
    from flows.dvc_task import dvc_stages

    write_multi30k_mirror(tmp_path / "mirror")
    repo = _tiny_repository(tmp_path)
    env = {**server.env, **built_env(tmp_path), "HOME": str(tmp_path / "home")}
    dep = _deploy(server, repo, name="tiny")
    first = _run_once(server, dep, tmp_path / "worker-1", env)
    second = _run_once(server, dep, tmp_path / "worker-2", env)
    stages = dvc_stages(repo)
    assert first == dict.fromkeys(stages, "ran"), first
    assert list(second) == stages and set(second.values()) <= {"restored", "skipped"}, second

    remote = tmp_path / "home" / ".cache" / "wmt14-transformer" / "dvc-remote"
    objects = {path: _pushed_object(remote, path) for path in ("runs/tiny/model/averaged.pt", "reports/tiny/audit.md")}
    assert all(hashlib.md5(obj.read_bytes()).hexdigest() == obj.parent.name + obj.name  # noqa: S324 - DVC's hash
               for obj in objects.values()), objects
    print(f"\ntiny deployment, run 1: {first}\nrun 2: {second}\nremote: {objects}")


def _pushed_object(remote: Path, path: str) -> Path:
    """The remote's object of the file ``path``, by the md5 its run cache records for the output holding it (the file
    itself, or a folder whose ``.dir`` listing names it)."""
    entries = [yaml.safe_load(entry.read_text()) for entry in (remote / "runs").rglob("*") if entry.is_file()]
    out = next(out for entry in entries for out in entry["outs"] if f"{path}/".startswith(f"{out['path']}/"))
    md5, inside = out["md5"], path.removeprefix(out["path"]).lstrip("/")
    if inside:
        listing = json.loads((remote / "files" / "md5" / md5[:2] / md5[2:]).read_text())
        md5 = next(item["md5"] for item in listing if item["relpath"] == inside)
    return remote / "files" / "md5" / md5[:2] / md5[2:]
