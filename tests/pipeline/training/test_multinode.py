"""Multi-node training for real on one machine: two launchers as two "nodes" (``NMT_NNODES=2``, c10d
rendezvous on a loopback port, gloo, one CPU process each), checked against one node with two processes.

* Same model: the two nodes train the same global batches and end with the same weights, bit for bit
  (dropout 0).
* A node's agent killed mid-run: the other node's rank fails at its next collective, its agent restarts
  the group (``NMT_MAX_RESTARTS``) and waits at the rendezvous; the killed node's launcher is started
  again (torchrun never restarts a dead agent: a scheduler does), and the job resumes from the newest
  checkpoint to the uninterrupted run's model.
* A node that never joins: the other stops after ``NMT_RDZV_TIMEOUT_S`` with one line naming the
  endpoint and the timeout; losing the node that hosts the rendezvous store ends the other with one line.
* Nothing the job starts listens beyond loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core.errors import ConfigError
from pipeline.training import torchrun
from tests.helpers import faultutil as fu
from tests.helpers.httpserver import serve
from tests.helpers.nodes import LoopbackJob, free_port
from tests.helpers.paths import REPO
from tests.helpers.train import checkpoints, make_workspace, tiny_params

STEPS = 8
NO_DROPOUT = {"dropout": 0.0, "attn_dropout": 0.0, "ffn_dropout": 0.0}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_workspace(tmp_path_factory.mktemp("ws"))


def _params(tmp: Path, ws: dict[str, Path]) -> dict:
    data = tiny_params(tmp, ws, max_steps=STEPS, save_every_steps=2, valid_every_steps=4)
    data["model"].update(NO_DROPOUT)
    return data


@pytest.fixture(scope="module")
def one_node(workspace: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: one node with two processes (``NMT_NPROC=2``), run to the end."""
    tmp = tmp_path_factory.mktemp("one-node")
    code, out = fu.run(_params(tmp, workspace), tmp, nproc=2, timeout=300)
    assert code == 0, out[-3000:]
    return tmp


def _assert_same_model(one_node: Path, two_nodes: Path) -> None:
    """The same global batches and the same weights and Adam state, bit for bit (so also to 1e-6): the two
    setups have the same world size and rank order, and gloo sums the two ranks' gradients the same way."""
    state = json.loads((checkpoints(two_nodes) / f"step-{STEPS:08d}" / "state.json").read_text())
    assert state["world_size"] == 2
    fu.assert_bitwise_equal(one_node, two_nodes, STEPS)


def _stall_fault(tmp: Path, step: int, rank: int) -> dict[str, str]:
    """Rank ``rank`` stalls once before step ``step``'s all-reduce; torchrun may restart a rank once."""
    return {"NMT_FAULT_POINT": f"collective:{step}:stall:{rank}@{tmp / 'stalled'}", "NMT_MAX_RESTARTS": "1"}


def _start_two_until_stalled(job: LoopbackJob, stalling: int) -> tuple:
    """Start both nodes and wait until node ``stalling`` (0 or 1) reports its stall (or ends)."""
    nodes = job.start_node(), job.start_node()
    node = nodes[stalling]
    assert fu.wait_for(lambda: "stalling" in job.log(node) or node.poll() is not None, 180, 0.2), \
        job.log(node)[-3000:]
    return nodes


def _exposed(job: LoopbackJob) -> list[tuple[int, str, int, bool]]:
    return [s for s in job.sockets() if not s[3]]


@pytest.mark.slow
def test_two_nodes_on_loopback_train_the_model_of_one_node_with_two_processes(workspace, one_node, tmp_path):
    params = fu.write_params(_params(tmp_path, workspace), tmp_path)
    with LoopbackJob(params, tmp_path) as job:
        first, second = job.start_node(), job.start_node()
        (code0, out0), (code1, out1) = job.finish(first), job.finish(second)
    assert code0 == 0 and code1 == 0, (out0[-3000:], out1[-3000:])
    assert "training on 2 process(es)" in out0  # rank 0 of a world of 2, on the first node
    assert f"--rdzv_endpoint={job.endpoint}" in out0 and "--local_addr=127.0.0.1" in out0
    assert fu.steps(checkpoints(tmp_path))[-1] == STEPS
    _assert_same_model(one_node, tmp_path)


@pytest.mark.slow
def test_a_killed_node_agent_started_again_resumes_the_job_from_the_newest_checkpoint(workspace, one_node, tmp_path):
    """Rank 1 (the second node) stalls before step 5's all-reduce, once; then its agent is SIGKILLed."""
    params = fu.write_params(_params(tmp_path, workspace), tmp_path)
    with LoopbackJob(params, tmp_path, env=_stall_fault(tmp_path, 5, rank=1)) as job:
        first, second = _start_two_until_stalled(job, stalling=1)
        assert second.poll() is None and fu.steps(checkpoints(tmp_path)) == [2, 4], job.log(second)[-3000:]
        listening = job.sockets()
        assert job.port in {port for _, _, port, _ in listening} and len(listening) >= 3, listening
        assert not _exposed(job), f"listening beyond loopback: {_exposed(job)}"
        os.kill(second.pid, signal.SIGKILL)  # the agent only: its rank dies with it (PR_SET_PDEATHSIG)
        second.wait()
        replacement = job.start_node()  # what Slurm's requeue or a Kubernetes Job would do
        (code0, out0), (code2, out2) = job.finish(first), job.finish(replacement)
    assert code0 == 0 and code2 == 0, (out0[-3000:], out2[-3000:])
    assert "error: stage train: rank 0: collective" in out0 and "failed: a peer rank died" in out0
    # the same agent (its launcher never ended) started its rank again: torchrun's restart (NMT_MAX_RESTARTS=1)
    assert out0.count("training on 2 process(es)") == 2 and "resuming from" in out0 and "step-00000004" in out0
    assert fu.steps(checkpoints(tmp_path))[-1] == STEPS
    _assert_same_model(one_node, tmp_path)


@pytest.mark.slow
def test_a_node_that_never_joins_ends_the_other_with_one_line_naming_the_endpoint_and_timeout(workspace, tmp_path):
    params = fu.write_params(_params(tmp_path, workspace), tmp_path)
    with LoopbackJob(params, tmp_path, env={"NMT_RDZV_TIMEOUT_S": "5"}) as job:
        started = time.monotonic()
        alone = job.start_node()
        code, out = job.finish(alone, timeout=120)
        elapsed = time.monotonic() - started
    assert code == 1, out[-3000:]
    assert [line for line in out.splitlines() if line.startswith("error:")] == [
        f"error: stage train: rendezvous '{job.rdzv_id}' at {job.endpoint} (NMT_RDZV_ENDPOINT) timed out after 5 s "
        "(NMT_RDZV_TIMEOUT_S): fewer than NMT_NNODES=2 nodes joined; start the missing node(s) with the same "
        "NMT_RDZV_ENDPOINT and NMT_RDZV_ID, or raise NMT_RDZV_TIMEOUT_S"], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert elapsed < 5 + 60, elapsed  # the timeout, torchrun's 5 s rollback and the start-up on 2 busy cores
    assert not fu.workers_of(params) and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_losing_the_node_that_hosts_the_rendezvous_ends_the_other_with_one_line(workspace, tmp_path):
    """Rank 0 (the first node, the rendezvous store's host) stalls before step 3's all-reduce; its agent is
    SIGKILLed. The second node's rank fails, its agent restarts and finds no store: one line, not a hang."""
    params = fu.write_params(_params(tmp_path, workspace), tmp_path)
    with LoopbackJob(params, tmp_path, env=_stall_fault(tmp_path, 3, rank=0)) as job:
        first, second = _start_two_until_stalled(job, stalling=0)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        started = time.monotonic()
        code, out = job.finish(second, timeout=180)
        elapsed = time.monotonic() - started
    assert code == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors[-1].startswith(f"error: stage train: lost the rendezvous store at {job.endpoint} "
                                 "(NMT_RDZV_ENDPOINT): the node hosting it stopped or cannot be reached; start every "
                                 "node again (training resumes from the newest checkpoint) ["), out[-3000:]
    assert "Traceback" not in out and elapsed < 90, (elapsed, out[-3000:])
    assert fu.wait_for(lambda: not fu.workers_of(params), 30)


def test_rendezvous_errors_are_one_line_naming_the_endpoint(monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError

    from pipeline.training.agent import rendezvous_error_message

    monkeypatch.setenv("NMT_NNODES", "3")
    monkeypatch.setenv("NMT_RDZV_ENDPOINT", "node0.internal:29400")
    monkeypatch.setenv("NMT_RDZV_ID", "job-7")
    assert rendezvous_error_message(RendezvousTimeoutError()) == (
        "rendezvous 'job-7' at node0.internal:29400 (NMT_RDZV_ENDPOINT) timed out after 600 s (NMT_RDZV_TIMEOUT_S): "
        "fewer than NMT_NNODES=3 nodes joined; start the missing node(s) with the same NMT_RDZV_ENDPOINT and "
        "NMT_RDZV_ID, or raise NMT_RDZV_TIMEOUT_S")
    lost = RendezvousConnectionError("The connection to the C10d store has failed. See inner exception for details.")
    lost.__cause__ = RuntimeError("Connection reset by peer\nException raised from recvBytes")
    assert rendezvous_error_message(lost) == (
        "lost the rendezvous store at node0.internal:29400 (NMT_RDZV_ENDPOINT): the node hosting it stopped or cannot "
        "be reached; start every node again (training resumes from the newest checkpoint) [Connection reset by peer]")
    lost.__cause__ = RuntimeError("Ping failed, invalid value returned from server. Expected: 2645, Got: 1329865020")
    assert rendezvous_error_message(lost) == (  # "<!DO": an HTTP server's error page where the ping's echo should be
        "rendezvous 'job-7' at node0.internal:29400 (NMT_RDZV_ENDPOINT): what answered there is not a rendezvous "
        "store (another program on that port?); check NMT_RDZV_ENDPOINT and NMT_RDZV_ID on every node [Ping failed, "
        "invalid value returned from server. Expected: 2645, Got: 1329865020]")
    import torch.distributed as dist  # a store operation's error, which torchrun's agent leaves raw

    assert rendezvous_error_message(dist.DistStoreError("wait timed out after 600000ms")).startswith(
        "rendezvous 'job-7' at node0.internal:29400 (NMT_RDZV_ENDPOINT) timed out after 600 s (NMT_RDZV_TIMEOUT_S)")
    assert rendezvous_error_message(dist.DistNetworkError("Connection reset by peer\nframe #0")) == (
        "lost the rendezvous store at node0.internal:29400 (NMT_RDZV_ENDPOINT): the node hosting it stopped or cannot "
        "be reached; start every node again (training resumes from the newest checkpoint) [Connection reset by peer]")


def test_a_loopback_rendezvous_keeps_every_node_on_loopback_and_passes_the_join_timeout(monkeypatch):
    monkeypatch.setenv("NMT_NNODES", "2")
    monkeypatch.setenv("NMT_NPROC", "1")
    monkeypatch.setenv("NMT_MAX_RESTARTS", "2")
    monkeypatch.setenv("NMT_RDZV_ENDPOINT", "127.0.0.1:29411")
    monkeypatch.setenv("NMT_RDZV_TIMEOUT_S", "30")
    assert torchrun.torchrun_command([])[4:] == [
        "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:29411",
        "--rdzv_id=nmt-train", "--rdzv_conf=join_timeout=30,read_timeout=30", "--local_addr=127.0.0.1",
        "--max-restarts=2", "-m", "pipeline.train"]
    monkeypatch.setenv("NMT_RDZV_ENDPOINT", "node0.internal:29400")  # a cluster: each node's own address
    monkeypatch.delenv("NMT_RDZV_TIMEOUT_S")
    cmd = torchrun.torchrun_command([])
    assert "--rdzv_conf=join_timeout=600,read_timeout=60" in cmd
    assert not any(a.startswith("--local_addr") for a in cmd)
    monkeypatch.setenv("NMT_NODE_RANK", "1")  # the static rendezvous waits as long
    assert "--rdzv_conf=timeout=600" in torchrun.torchrun_command([])


@pytest.mark.parametrize(("name", "value", "message"), [
    ("NMT_RDZV_ENDPOINT", "127.0.0.1:0", "environment: NMT_RDZV_ENDPOINT='127.0.0.1:0': port 0 picks another free "
     "port on each node, so they never meet; name a fixed free port in 1..65535, e.g. 29400"),
    ("NMT_RDZV_ENDPOINT", "node0:99999", "environment: NMT_RDZV_ENDPOINT='node0:99999': port 99999 is out of range; "
     "name a fixed free port in 1..65535, e.g. 29400"),
    ("NMT_RDZV_ENDPOINT", "node0:29400:1", "environment: NMT_RDZV_ENDPOINT='node0:29400:1': expected host:port of "
     "the rendezvous, e.g. node0.internal:29400"),
    ("NMT_RDZV_TIMEOUT_S", "0", "environment: NMT_RDZV_TIMEOUT_S='0': Input should be greater than or equal to 1"),
])
def test_a_bad_rendezvous_setting_is_one_line_naming_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv("NMT_NNODES", "2")
    monkeypatch.setenv("NMT_RDZV_ENDPOINT", "127.0.0.1:29400")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        torchrun.torchrun_command([])
    assert str(info.value) == message


RDZV_TIMEOUT_S = 3
#: What each rendezvous that cannot complete ends with (``{where}``: the endpoint as the line names it).
HUNG = ("error: stage train: rendezvous 'nmt-train' at {where} did not complete within 3 s (NMT_RDZV_TIMEOUT_S): "
        "nothing there answered as a rendezvous store (another program on that port?) or fewer than NMT_NNODES=2 "
        "nodes joined; check NMT_RDZV_ENDPOINT and NMT_RDZV_ID on every node, or raise NMT_RDZV_TIMEOUT_S")
NOT_A_STORE = ("error: stage train: rendezvous 'nmt-train' at {where}: what answered there is not a rendezvous store "
               "(another program on that port?); check NMT_RDZV_ENDPOINT and NMT_RDZV_ID on every node [Ping failed, ")
ALONE = ("error: stage train: rendezvous 'nmt-train' at {where} timed out after 3 s (NMT_RDZV_TIMEOUT_S): fewer than "
         "NMT_NNODES=2 nodes joined; start the missing node(s) with the same NMT_RDZV_ENDPOINT, or "
         "raise NMT_RDZV_TIMEOUT_S")
UNRESOLVED = (r"error: stage train: environment: NMT_RDZV_ENDPOINT='nonexistent\.invalid:29400': host "
              r"'nonexistent\.invalid' did not resolve within 3 s \(NMT_RDZV_TIMEOUT_S\) \[[^]]+\]; name a host every "
              r"node can resolve \(node 0's name or address\), or raise NMT_RDZV_TIMEOUT_S if its name is published later")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unresolvable", "http-server", "static-node-0-alone", "static-node-1-alone"])
def test_every_rendezvous_wait_ends_within_the_timeout_with_one_line_naming_the_endpoint(tmp_path, case):
    """``NMT_RDZV_TIMEOUT_S`` bounds each way a rendezvous can wait: a host that does not resolve, a port where
    something other than a store answers (it never replies to the store's handshake, or replies with an error
    page when a newline is among the handshake's random bytes), and a static rendezvous
    whose other node is missing (node 0 waits for its clients, node 1 for node 0's store). No rank starts, so
    the tiny profile's params (its data never made) are enough."""
    from pipeline.project.profiles import render
    from pipeline.training.agent import RDZV_GRACE_S

    params = tmp_path / "params.yaml"
    params.write_text(render("tiny", REPO), encoding="utf-8")
    with contextlib.ExitStack() as stack:
        if case == "unresolvable":
            rdzv = {"NMT_RDZV_ENDPOINT": "nonexistent.invalid:29400"}
        elif case == "http-server":
            url, _ = stack.enter_context(serve(tmp_path))
            rdzv = {"NMT_RDZV_ENDPOINT": url.removeprefix("http://").rstrip("/")}
            where = f"{rdzv['NMT_RDZV_ENDPOINT']} (NMT_RDZV_ENDPOINT)"
            expected = HUNG.format(where=where)
            not_a_store = NOT_A_STORE.format(where=where)  # the server answers when the store's ping holds a newline
        else:
            port = free_port()
            rdzv = {"NMT_NODE_RANK": case[len("static-node-")], "NMT_RDZV_ENDPOINT": f"127.0.0.1:{port}"}
            expected = ALONE.format(where=f"127.0.0.1:{port} (NMT_RDZV_ENDPOINT, static)")
        env = fu.job_env(1, {"NMT_NNODES": "2", "NMT_RDZV_TIMEOUT_S": str(RDZV_TIMEOUT_S), **rdzv})
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.launch", "--params", str(params)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        elapsed = time.monotonic() - started
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    if case == "unresolvable":
        assert len(errors) == 1 and re.fullmatch(UNRESOLVED, errors[0]), out[-3000:]
    elif case == "http-server":
        assert errors == [expected] or len(errors) == 1 and errors[0].startswith(not_a_store), out[-3000:]
    else:
        assert errors == [expected], out[-3000:]
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "frame #" not in out and "[c10d]" not in out, out[-3000:]
    # the timeout, the watchdog's grace, and the start-up (torch's import) on 2 busy cores
    assert elapsed < RDZV_TIMEOUT_S + RDZV_GRACE_S + 20, elapsed
