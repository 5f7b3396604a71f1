"""Stopping a flow stops its work, and two flows never share a workspace: real processes throughout.

``python -m flows.pipeline`` runs as a user would start it (its own temporary Prefect server, no
``PREFECT_API_URL``), in its own process group. The toy stage ``count`` works in 0.2 s steps with a
child process, keeps its progress in a ``persist: true`` output and records its pids, so a test can
see that the stage's whole tree ends when the flow is stopped, and that the next run resumes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.pipeline import wmt14_pipeline
from pipeline.core.errors import PipelineError
from tests.helpers.toyflow import MakeRepo, alive, group_pids, wait_dead, wait_for, wait_gone

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]

STEPS = 40
GRACE_S = 3
COUNT = {"count": {"cmd": f"python toy.py count work.txt out.txt {STEPS} pids.txt", "deps": ["toy.py"],
                   "outs": [{"work.txt": {"persist": True, "cache": False}}, "out.txt"]}}


def _start_flow(repo: Path, repo_root: Path, *, api_url: str | None = None,
                profile: str | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    env.pop("PREFECT_API_URL", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    # As a terminal's foreground job: SIGINT not ignored. A shell's background job (and so pytest started with
    # `&` from a script) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
    unignore = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                "os.execv(sys.executable, [sys.executable, '-m', 'flows.pipeline', *sys.argv[1:]])")
    extra = ["--profile", profile] if profile else []
    return subprocess.Popen([sys.executable, "-c", unignore, "--repo", str(repo), "--kill-grace", str(GRACE_S), *extra],
                            cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _tied_to(pid: int) -> list[int]:
    """Processes still running under a lifeline to ``pid`` (the stage's and the temporary server's)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"flows.lifeline" in cmd and b"--parent" in cmd and cmd[cmd.index(b"--parent") + 1] == str(pid).encode():
            found.append(int(entry.name))
    return [p for p in found if alive(p)]


def _progress(repo: Path) -> int:
    path = repo / "work.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "sigkill"])
def test_stopping_the_flows_group_ends_the_stage_tree_and_the_next_run_resumes(
        sig: signal.Signals, make_repo: MakeRepo, repo_root: Path) -> None:
    repo = make_repo(COUNT)
    proc = _start_flow(repo, repo_root, profile="tiny")  # the workspace switches to tiny and stays so
    try:
        wait_for(repo / "pids.txt", proc)
        while _progress(repo) < 3:
            assert proc.poll() is None
            time.sleep(0.1)
        child, stage = map(int, (repo / "pids.txt").read_text().split())
        os.killpg(proc.pid, sig)  # what Ctrl-C in a terminal, `kill -- -PGID` or `kill -9 -- -PGID` do
        stopped = time.monotonic()
        output = proc.communicate(timeout=60)[0].decode()
        assert wait_dead([child, stage], GRACE_S + 5) == [], output
        assert wait_dead(_tied_to(proc.pid), GRACE_S + 10) == [], output  # the stage's and the server's
        assert time.monotonic() - stopped < GRACE_S + 20, output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert yaml.safe_load((repo / "params.yaml").read_text())["profile"] == "tiny"  # however it was stopped
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "error: interrupted: the running stage was stopped" in output, output
    elif sig == signal.SIGTERM:  # Prefect records the crash, then ends the process by the same signal
        assert proc.returncode == -sig and "Execution was aborted by a termination signal" in output, output
    else:
        assert proc.returncode == -sig
    assert "Traceback" not in output and "ConnectError" not in output, output
    assert "Starting temporary server" not in output, output  # Prefect's own, in the flow's group: never started
    assert "View at" not in output, output  # no link to a server without a UI that ends with the run
    kept = _progress(repo)
    assert 3 <= kept < STEPS and not (repo / "out.txt").exists()
    lock = repo / "dvc.lock"
    assert "count" not in ((yaml.safe_load(lock.read_text()) or {}).get("stages", {}) if lock.exists() else {})

    out = wmt14_pipeline(repo=str(repo))  # the next run resumes where the stopped one was, on the same profile
    assert out["stages"][0]["status"] == "ran"
    assert yaml.safe_load((repo / "params.yaml").read_text())["profile"] == "tiny"
    assert (repo / "work.txt").read_text().splitlines() == [str(i) for i in range(STEPS)]
    done = subprocess.run(["dvc", "status", "-q"], cwd=repo, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr  # dvc.lock matches the workspace


def test_a_second_flow_in_the_same_workspace_is_refused_at_once(make_repo: MakeRepo, repo_root: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    repo = make_repo(COUNT)
    first = _start_flow(repo, repo_root, api_url=str(PREFECT_API_URL.value()))
    try:
        wait_for(repo / "pids.txt", first)
        params = (repo / "params.yaml").read_text()
        started = time.monotonic()
        with pytest.raises(PipelineError, match=rf"nmt-pipeline.lock: another pipeline run holds this workspace "
                                                rf"\(pid {first.pid}, since .*\); wait for it to end or stop it"):
            wmt14_pipeline(repo=str(repo), profile="tiny")
        assert time.monotonic() - started < 10
        assert (repo / "params.yaml").read_text() == params  # --profile never rewrote it under the first run
        assert first.poll() is None
    finally:
        # the run's processes: its own group and the group of each lifeline tied to it (its `dvc repro`)
        group = group_pids(first.pid) + [p for tied in _tied_to(first.pid) for p in group_pids(tied)]
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # the lifeline ends the killed run's `dvc repro`; DVC's own lock lets a new run in once it has left /proc
    assert wait_gone(group, GRACE_S + 10) == []
    assert wmt14_pipeline(repo=str(repo))["stages"][0]["status"] == "ran"  # the dead run's lock is gone


def test_ctrl_c_of_a_flow_whose_stage_runs_torchrun_is_one_line_without_torchruns_output(
        make_repo: MakeRepo, repo_root: Path) -> None:
    """The stage is torchrun's agent (``python -m pipeline.launch --torchrun``, as the train stage runs it) with one
    rank counting; the flow stops it with SIGTERM. What torchrun prints while it dies is not shown."""
    agent = ("python -m pipeline.launch --torchrun --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:0 "
             "--local_addr=127.0.0.1 --nnodes=1 --nproc_per_node=1")
    repo = make_repo({"count": {**COUNT["count"], "cmd": f"{agent} toy.py count work.txt out.txt {STEPS} pids.txt"}})
    proc = _start_flow(repo, repo_root)
    try:
        wait_for(repo / "pids.txt", proc)
        child, rank = map(int, (repo / "pids.txt").read_text().split())
        os.killpg(proc.pid, signal.SIGINT)
        output = proc.communicate(timeout=90)[0].decode()
        assert wait_dead([child, rank], GRACE_S + 5) == [], output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, output
    assert [line for line in output.splitlines() if "error" in line.lower() and "Crash" not in line
            and "Crashed" not in line] == [
        "error: interrupted: the running stage was stopped (a checkpoint being written is discarded); run the same "
        "command again to resume"], output
    for torchruns_own in ("Traceback", "SignalException", "death signal", "closing signal", "training stopped"):
        assert torchruns_own not in output, output
