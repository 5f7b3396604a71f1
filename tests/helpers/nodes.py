"""Several torchrun "nodes" on this machine: ``python -m pipeline.launch`` processes of one multi-node job
(``NMT_NNODES``) that meet at a c10d rendezvous on a free loopback port, one CPU process each."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import faultutil as fu
from tests.helpers.paths import REPO


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoopbackJob:
    """The launchers of one multi-node job on 127.0.0.1: the same params file, one process per node.

    Args:
        params: the params file every node trains (one checkout, one shared ``paths.train``).
        folder: where each node's output goes (``node-<n>.log``).
        nnodes: ``NMT_NNODES``.
        env: more variables for every node (a fault, ``NMT_MAX_RESTARTS``, ``NMT_RDZV_TIMEOUT_S``).
    """

    def __init__(self, params: Path, folder: Path, nnodes: int = 2, env: dict[str, str] | None = None) -> None:
        self.params, self.folder = params, folder
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.rdzv_id = f"test-{folder.name}"
        self.env = fu.job_env(1, {"NMT_NNODES": str(nnodes), "NMT_RDZV_ENDPOINT": self.endpoint,
                                  "NMT_RDZV_ID": self.rdzv_id, **(env or {})})
        self.procs: list[subprocess.Popen] = []

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def start_node(self) -> subprocess.Popen:
        """Start one more node's launcher (its own process group), as ``srun``/a pod would.

        The first one is waited for until it listens on the rendezvous port: it hosts the rendezvous
        store and, started first (the lower pid), becomes group rank 0, so the tests know which node to kill.
        """
        n = len(self.procs)
        log = open(self.folder / f"node-{n}.log", "w", encoding="utf-8")  # noqa: SIM115 - closed by finish/close
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.launch", "--params", str(self.params)], cwd=REPO,
                                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc.log_path = self.folder / f"node-{n}.log"  # type: ignore[attr-defined]
        proc.log_file = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        if n == 0:
            hosting = fu.wait_for(lambda: proc.poll() is not None or self.port in self.ports(), 120, 0.1)
            assert hosting and proc.poll() is None, self.log(proc)[-3000:]
        return proc

    def ports(self) -> set[int]:
        """Ports every live process of the job listens on."""
        return {port for _, _, port, _ in self.sockets()}

    def sockets(self) -> list[tuple[int, str, int, bool]]:
        """Every listening TCP socket of the job's launchers and ranks: (pid, address, port, is_loopback)."""
        pids = [pid for proc in self.procs if proc.poll() is None for pid in fu.process_tree(proc.pid)]
        return fu.listening_sockets(pids)

    @staticmethod
    def log(proc: subprocess.Popen) -> str:
        return proc.log_path.read_text(encoding="utf-8")  # type: ignore[attr-defined]

    def finish(self, proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
        """Wait for one node's launcher to end; its exit code and output."""
        return fu.finish(proc, timeout)

    def close(self) -> None:
        """Kill whatever is left of the job (each node's process group) and close the logs."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if not proc.log_file.closed:  # type: ignore[attr-defined]
                proc.log_file.close()  # type: ignore[attr-defined]

    def __enter__(self) -> LoopbackJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
