"""The training launcher's attack surface and its clean-up: real 2-rank torchrun jobs (gloo on CPU).

* Every TCP socket the job listens on (torchrun's rendezvous store, the store the ranks share, gloo's
  sockets) is bound to loopback on a single node: nothing on the network can reach the
  unauthenticated stores.
* SIGKILL of the launcher's process group at any moment of start-up leaves no worker behind: each
  worker arms ``PR_SET_PDEATHSIG`` before its slow imports and exits at once when its agent already died.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import launch
from pipeline.training import torchrun
from tests.helpers import faultutil as fu
from tests.helpers.paths import REPO
from tests.helpers.train import make_workspace, tiny_params

STALL = {"NMT_FAULT_POINT": "collective:2:stall"}  # every rank hangs before step 2's all-reduce: the job stays up


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_workspace(tmp_path_factory.mktemp("ws"))


def _params(tmp: Path, ws: dict[str, Path]) -> dict:
    return tiny_params(tmp, ws, max_steps=50, tokens_per_step=384, save_every_steps=100, valid_every_steps=100)


def _log(proc) -> str:
    return proc.log_path.read_text(encoding="utf-8")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill_job(proc) -> None:
    with_group = proc.poll() is None
    if with_group:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.log_file.close()


@pytest.mark.slow
def test_a_single_node_job_listens_on_loopback_only(workspace, tmp_path):
    proc = fu.start(_params(tmp_path, workspace), tmp_path, env=STALL)
    try:
        assert fu.wait_for(lambda: "stalling" in _log(proc) or proc.poll() is not None, 90), _log(proc)[-3000:]
        assert proc.poll() is None, _log(proc)[-3000:]
        tree = fu.process_tree(proc.pid)
        assert len(tree) >= 3  # the torchrun agent and its two ranks
        sockets = fu.listening_sockets(tree)
        assert len({pid for pid, *_ in sockets}) >= 2, sockets  # the agent's stores and the ranks' gloo sockets
        exposed = [(pid, _cmdline(pid)[:80], f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}") for pid, addr, port, loopback in sockets
                   if not loopback]
        assert not exposed, f"listening beyond loopback: {exposed}"
    finally:
        _kill_job(proc)
        fu.wait_for(lambda: not fu.workers_of(tmp_path / "params.yaml"), 30)


@pytest.mark.slow
def test_sigkill_of_the_launcher_at_any_moment_of_start_up_leaves_no_worker(workspace, tmp_path):
    """Kill moments: fixed delays after the start, as soon as a rank process exists and a little after
    (inside its imports, the window the fix closes), and once training runs."""
    moments: list[tuple[str, object]] = [("0.5 s", 0.5), ("1.5 s", 1.5), ("3 s", 3.0),
                                         ("rank spawned", "spawned"), ("rank spawned + 1 s", "spawned+1"),
                                         ("training", "training")]
    survivors: dict[str, list[str]] = {}
    leftover: list[int] = []
    for i, (name, when) in enumerate(moments):
        tmp = tmp_path / f"kill-{i}"
        proc = fu.start(_params(tmp, workspace), tmp, env=STALL)
        if isinstance(when, float):
            time.sleep(when)
        elif when.startswith("spawned"):
            # the launcher execs torchrun's agent (same pid), whose children are the ranks
            assert fu.wait_for(lambda p=proc: len(fu.process_tree(p.pid)) > 1 or p.poll() is not None, 60, 0.01)
            time.sleep(1.0 if when.endswith("+1") else 0.0)
        else:
            assert fu.wait_for(lambda p=proc: "stalling" in _log(p) or p.poll() is not None, 90)
        assert proc.poll() is None, _log(proc)[-3000:]
        _kill_job(proc)
        params = tmp / "params.yaml"
        if not fu.wait_for(lambda p=params: not fu.workers_of(p), 60, 0.2):
            pids = fu.workers_of(params)
            survivors[name] = [f"pid {pid} ppid {_ppid(pid)}: {_cmdline(pid)[:100]}" for pid in pids]
            leftover += pids
    for pid in leftover:  # the orphans this test made
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not survivors, f"workers alive 60 s after SIGKILL of the launcher's process group: {survivors}"


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


_STORES = """
import json, os
from pipeline.training import agent
agent.bind_stores_to_their_host()
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous
from tests.helpers import faultutil as fu
rdzv = c10d_rendezvous_backend.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
static = static_tcp_rendezvous.TCPStore("localhost", 0, None, True, multi_tenant=True)
shared = dist.TCPStore("127.0.0.1", rdzv.port, is_master=True, multi_tenant=True)  # reuses rdzv's server
shared.set("k", "v")
print(json.dumps({"get": rdzv.get("k").decode(), "sockets": fu.listening_sockets([os.getpid()])}))
"""


def test_torchruns_store_servers_listen_on_their_host_only():
    """torch binds a TCPStore server to every interface whatever its host; the agent's are patched."""
    out = subprocess.run([sys.executable, "-c", _STORES], check=False, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["get"] == "v"
    assert len(got["sockets"]) == 2 and all(loopback for *_, loopback in got["sockets"]), got


def test_ranks_bind_gloo_and_nccl_to_loopback_when_the_store_is_local(monkeypatch):
    from pipeline.training import distributed

    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # several nodes: left to gloo / NCCL (or the user)
    distributed.bind_to_loopback_if_local()
    assert "GLOO_SOCKET_IFNAME" not in os.environ and "NCCL_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice is kept
    distributed.bind_to_loopback_if_local()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


def test_a_rank_whose_agent_is_gone_exits_before_importing_anything(tmp_path):
    """``PIPELINE_AGENT_PID`` names the agent; a rank whose parent is not that process was orphaned."""
    cmd = [sys.executable, "-m", "pipeline.train", "--params", str(tmp_path / "missing.yaml")]
    env = {**os.environ, launch.AGENT_PID_ENV: "1"}  # reparented to init
    orphan = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert orphan.returncode == -signal.SIGKILL and not orphan.stderr, orphan.stderr[-2000:]
    env[launch.AGENT_PID_ENV] = str(os.getpid())  # its real parent: goes on (and fails on the missing params)
    child = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == 1 and "missing.yaml" in child.stderr, child.stderr[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_stopped_agent_ends_its_ranks_with_one_line_not_torchruns_traceback(tmp_path, sig):
    """SIGTERM to the launcher's group is how the flow stops a stage (flows/lifeline.py); Ctrl-C in a terminal
    sends SIGINT. The ranks here only sleep and end quietly, as a stage's ranks do (pipeline/core/console.py): what
    is left is the agent's own output, torch's warnings and one line instead of its traceback."""
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(f"import os, pathlib, time\npathlib.Path({str(ranks)!r}, str(os.getpid())).write_text('')\n"
                       "try:\n    time.sleep(600)\nexcept KeyboardInterrupt:\n    raise SystemExit(130)\n",
                       encoding="utf-8")
    cmd = [sys.executable, "-m", "pipeline.launch", torchrun.AGENT_FLAG, "--rdzv_backend=c10d",
           "--rdzv_endpoint=127.0.0.1:0", f"--local_addr={torchrun.LOOPBACK}", "--nnodes=1", "--nproc_per_node=2",
           str(sleeper)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=fu.job_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        assert fu.wait_for(lambda: len(list(ranks.iterdir())) == 2 or proc.poll() is not None, 120, 0.1)
        assert proc.poll() is None
        os.killpg(proc.pid, sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + sig, out
    assert "Traceback" not in out and "SignalException" not in out, out
    (line,) = [line for line in out.splitlines() if "stopped" in line or "error" in line.lower()]
    assert line.endswith(f"ERROR pipeline.training.agent: training stopped by {sig.name} (its ranks too); run "
                         "the stage again to resume from the newest complete checkpoint"), out
    assert fu.wait_for(lambda: not any(Path(f"/proc/{p.name}").exists() for p in ranks.iterdir()), 10, 0.1)
