"""A temporary Prefect server for one local flow run, in its own session and tied to the flow's life.

Prefect's own temporary server runs in the flow's process group: a terminal's Ctrl-C (SIGINT to the
foreground group) or a ``kill -- -PGID`` ends it at the same moment as the flow, and the flow then
spends minutes retrying API calls (its task states, its report) against a server that is gone. This
one is ``prefect server start --no-ui --no-services`` on a free 127.0.0.1 port, under a
:mod:`flows.lifeline` in a new session: group signals aimed at the flow do not reach it, it stays up
while the flow stops its stages and records how the run ended (Prefect's exit-time flush of logs and
events included), and the lifeline stops it when the flow's process has exited, however it exited.

Prefect reads ``PREFECT_API_URL`` when it is imported, and its background threads (events, logs) keep
what they read then, so the URL must be in the environment before Prefect is imported:
``python -m flows.pipeline`` starts the server, then ``exec``s itself with the URL set (the pid, and
so the lifeline's tie, stays the same).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from flows import lifeline
from flows.dvc_task import kill_group
from pipeline.core.errors import PipelineError

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
_STOP_GRACE_S = 10.0


def free_port() -> int:
    """A port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def healthy(url: str) -> bool:
    """Whether the Prefect API at ``url`` answers its health check."""
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _startup_timeout_s() -> float:
    """``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``, as for Prefect's own temporary server (90 s)."""
    try:
        return float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90"))
    except ValueError:
        return 90.0


def start_temporary_server() -> str:
    """Start the server tied to this process; return its API URL (``http://127.0.0.1:PORT/api``).

    The server ends when this process does (its lifeline's ``PR_SET_PDEATHSIG``), after a grace of
    10 s; nothing needs to stop it explicitly.

    Raises:
        PipelineError: the server exited or was not healthy in time (its log's tail is in the message).
    """
    port = free_port()
    url = f"http://{HOST}:{port}/api"
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port), "--no-ui",
           "--no-services", "--analytics-off"]
    log_path = Path(tempfile.mkdtemp(prefix="nmt-prefect-")) / "server.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(lifeline.command(cmd, parent=os.getpid(), grace_s=_STOP_GRACE_S),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(proc, url, log_path)
    except BaseException:
        kill_group(proc.pid, proc, grace_s=_STOP_GRACE_S)
        raise
    finally:
        shutil.rmtree(log_path.parent, ignore_errors=True)  # the server keeps its open log; nothing is left
    log.info("temporary Prefect server on %s (it stops when this run ends)", url)
    return url


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    limit = _startup_timeout_s()
    deadline = time.monotonic() + limit
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
            how = (f"exited with code {proc.returncode}" if proc.returncode is not None
                   else f"not healthy in {limit:.0f} s")
            raise PipelineError(f"temporary Prefect server on {url} {how} (raise "
                                f"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS on a slow machine, or set "
                                f"PREFECT_API_URL to a running server); its log ends:\n{tail}")
        time.sleep(0.2)
