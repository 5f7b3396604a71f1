"""A temporary Prefect server for one local flow run, in its own session and tied to the flow's life.

Ours and not Prefect's: Prefect's own temporary server (``SubprocessASGIServer`` in prefect/server/api/server.py)
runs in the flow's process group and stops at the flow's ``atexit``, so a terminal's Ctrl-C ends it with the flow,
which then retries its API calls for minutes, and a SIGKILLed flow leaves it running. This one runs under a
:mod:`flows.lifeline` in a new session and stops once the flow's process has exited.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from flows import lifeline
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


def start_temporary_server() -> str:
    """Start the server tied to this process; return its API URL (a PipelineError quoting its log if not healthy)."""
    port = free_port()
    url = f"http://{HOST}:{port}/api"
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port), "--no-ui",
           "--no-services", "--analytics-off"]
    # The server keeps its log open; the folder goes when the server is healthy or has failed.
    with tempfile.TemporaryDirectory(prefix="nmt-prefect-", ignore_cleanup_errors=True) as folder:
        log_path = Path(folder) / "server.log"
        limit = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90"))  # Prefect checked it
        with log_path.open("wb") as out:
            proc = subprocess.Popen(lifeline.command(cmd, parent=os.getpid(), grace_s=_STOP_GRACE_S),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + limit
            while not healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(encoding="utf-8", errors="replace")[-4000:]
                    log.debug("temporary Prefect server's log ends:\n%s", tail)
                    raise PipelineError(startup_failure(url, proc.returncode, limit, tail))
                time.sleep(0.2)
        except BaseException:
            lifeline.kill_group(proc.pid, proc, grace_s=_STOP_GRACE_S)
            raise
    log.info("temporary Prefect server on %s (it stops when this run ends)", url)
    return url


#: The last exception line of a server log: ``module.Error: text`` (Python's traceback format).
_CAUSE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception): .*$", re.MULTILINE)


def startup_failure(url: str, returncode: int | None, limit_s: float, log_tail: str) -> str:
    """One line for a temporary server that exited (``returncode``) or was not healthy within ``limit_s``: the cause
    its log ends with, and the remedy for that cause."""
    from prefect.settings import PREFECT_HOME

    causes = _CAUSE.findall(log_tail)
    cause = f" [{causes[-1].strip()[:300]}]" if causes else ""
    if returncode is None:
        return (f"temporary Prefect server on {url} not healthy in {limit_s:.0f} s{cause}; raise "
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS on a slow machine, or set PREFECT_API_URL to a "
                "running server")
    if any(text in cause for text in ("unable to open database file", "readonly database", "Read-only file system",
                                      "Permission denied")):
        return (f"temporary Prefect server on {url} exited with code {returncode}: it cannot write its database "
                f"under PREFECT_HOME={PREFECT_HOME.value()}{cause}; set PREFECT_HOME to a writable folder (the "
                "Makefile uses .prefect in the checkout), or PREFECT_API_URL to a running server")
    return (f"temporary Prefect server on {url} exited with code {returncode}{cause or ' (its log names no error)'}; "
            "set PREFECT_API_URL to a running server, or fix what the error names")


def ensure_api(module: str, argv: list[str] | None) -> None:
    """With no ``PREFECT_API_URL``, start the temporary server and ``exec`` ``python -m MODULE ARGV`` with it set.

    Raises:
        PipelineError: ``PREFECT_API_URL`` is set but no Prefect server answers its health check there (Prefect's
            client would retry, then end the flow in a traceback of its connection error).
    """
    from prefect.settings import PREFECT_API_URL

    if url := PREFECT_API_URL.value():
        if not healthy(url.rstrip("/")):
            shown = re.sub(r"^(https?://)[^/]*@", r"\1***@", url)
            raise PipelineError(f"PREFECT_API_URL={shown}: no Prefect server answers there ({shown.rstrip('/')}"
                                "/health); start it (prefect server start) or unset PREFECT_API_URL, and the run "
                                "starts a temporary server of its own")
        return
    os.environ["PREFECT_API_URL"] = start_temporary_server()
    # No UI, and gone when the run ends: an empty UI URL keeps Prefect from logging a dead "View at" link
    # (prefect/utilities/urls.py url_for returns None without a base URL).
    os.environ.setdefault("PREFECT_UI_URL", "")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *(sys.argv[1:] if argv is None else argv)])
