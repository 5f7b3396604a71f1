"""What prefect.yaml's limits mean on a cluster, against a real ``prefect server start`` and two real process
workers on this host (two "nodes", ``--limit 1`` each): the deployment's ``concurrency_limit`` is one run of the
deployment across every worker of the pool, a run that finds it taken waits (ENQUEUE); without it the two workers
run two runs at once, one each. And the pull step that checks the worker's environment names what is missing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import REPO

PREFECT = str(Path(sys.executable).with_name("prefect"))
POOL = "two-nodes"
#: The longest a toy run holds its slot waiting for the other run of its pair to start: a run ends as soon as both
#: have started (the free pair) or after this long (the first of the limited pair, whose peer must wait for it).
#: A fixed 6 s hold was too short on a loaded 2-core machine, where a flow process takes seconds to start.
HOLD_S = 30
FLOW = textwrap.dedent(f'''
    import json, os, time
    from prefect import flow

    @flow
    def hold(log: str) -> None:
        start = time.time()
        with open(log + ".starts", "a") as starts:
            starts.write(os.environ["NODE"] + "\\n")
        while time.time() - start < {HOLD_S}:
            with open(log + ".starts") as starts:
                if len(starts.readlines()) >= 2:
                    break
            time.sleep(0.2)
        with open(log, "a") as out:
            out.write(json.dumps({{"worker": os.environ["NODE"], "start": start, "end": time.time()}}) + "\\n")
''')


def the_deployment() -> dict:
    """prefect.yaml's deployment."""
    return yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))["deployments"][0]


def environment_check() -> dict:
    """prefect.yaml's pull step that checks the worker's environment."""
    steps = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))["pull"]
    return next(s for s in steps if "MLFLOW_TRACKING_URI" in str(s))


@pytest.mark.usefixtures("prefect_harness")  # run_steps reports to a Prefect API
@pytest.mark.parametrize(("environ", "missing"), [
    ({"NMT_TRACKING": "on"}, True), ({"NMT_TRACKING": "on", "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}, False),
    ({"NMT_TRACKING": "off"}, False), ({}, True)])
def test_the_pull_step_names_a_missing_tracking_server(environ: dict[str, str], missing: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.deployments.steps.core import StepExecutionError, run_steps
    from prefect.utilities.asyncutils import run_coro_as_sync

    for name in ("NMT_TRACKING", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if not missing:
        run_coro_as_sync(run_steps([environment_check()]))
        return
    with pytest.raises(StepExecutionError) as failed:
        run_coro_as_sync(run_steps([environment_check()]))
    cause = str(failed.value.__cause__).strip()
    assert len(cause.splitlines()) == 1 and "MLFLOW_TRACKING_URI: is not set in the worker environment" in cause, cause


def deploy(folder: Path, environ: dict[str, str]) -> None:
    """The toy flow in ``folder`` as two deployments of the pool: ``limited`` with prefect.yaml's concurrency_limit,
    ``free`` without, registered by ``prefect deploy --all``."""
    (folder / "hold.py").write_text(FLOW, encoding="utf-8")
    common = {"entrypoint": "hold.py:hold", "work_pool": {"name": POOL}}
    spec = {"name": "toy", "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": str(folder)}}],
            "deployments": [{"name": "limited", **common, "concurrency_limit": the_deployment()["concurrency_limit"]},
                            {"name": "free", **common}]}
    (folder / "prefect.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    for cmd in ([PREFECT, "work-pool", "create", POOL, "--type", "process"],
                [PREFECT, "--no-prompt", "deploy", "--all"]):
        done = subprocess.run(cmd, cwd=folder, env=environ, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


def run_pair(deployment: str, folder: Path, environ: dict[str, str]) -> list[dict]:
    """Two runs of ``deployment`` started at once, each watched (``prefect deployment run --watch``) until the
    server has it Completed; the runs' records (start order). Waiting for the state, not only for the record the flow
    writes before it returns, leaves no run in flight when the workers are stopped: a worker asked to stop (SIGTERM)
    waits for its runs' processes (prefect/utilities/processutils setup_signal_handlers_worker)."""
    log = folder / f"{deployment}.jsonl"
    runs = [subprocess.Popen([PREFECT, "deployment", "run", f"hold/{deployment}", "-p", f"log={log}", "--watch",
                              "--watch-timeout", "240"], cwd=folder, env=environ, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    for run in runs:
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0, f"a run of {deployment} did not complete:\n{out[-3000:]}"
    return sorted((json.loads(line) for line in log.read_text().splitlines()), key=lambda r: r["start"])


@pytest.mark.slow
def test_the_deployment_limit_holds_across_two_workers_and_each_worker_runs_one(
        prefect_server: dict[str, str], tmp_path: Path) -> None:
    assert the_deployment()["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
    deploy(tmp_path, prefect_server)
    workers = []
    for node in ("node-a", "node-b"):
        with open(tmp_path / f"{node}.log", "wb") as out:
            workers.append(subprocess.Popen(
                [PREFECT, "worker", "start", "--pool", POOL, "--type", "process", "--limit", "1", "--name", node],
                cwd=tmp_path, env={**prefect_server, "NODE": node}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True))
    try:
        limited = run_pair("limited", tmp_path, prefect_server)
        free = run_pair("free", tmp_path, prefect_server)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:  # what is tested is the runs' order, not the worker's shutdown: on a loaded machine
            try:                # a worker stopping after SIGTERM has been seen to take over 60 s (no run is in flight)
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    assert limited[1]["start"] >= limited[0]["end"], limited  # one at a time, whichever worker took it
    assert free[1]["start"] < free[0]["end"], free  # two at once ...
    assert {r["worker"] for r in free} == {"node-a", "node-b"}, free  # ... one on each worker (--limit 1)
