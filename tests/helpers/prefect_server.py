"""``prefect server start`` on a free loopback port with its own PREFECT_HOME, for the tests that need a real one."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flows.server import free_port, healthy

#: How long a server gets to answer its health check.
START_S = 90


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the process group we started, SIGKILL it if it is still there after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def prefect_server(home: Path, env: dict[str, str], prefect: str = "prefect") -> Iterator[tuple[dict[str, str], Path]]:
    """A server under ``home`` (its PREFECT_HOME is ``home/home``), always stopped.

    Args:
        home: an empty folder of the test's.
        env: settings added to this process's environment (PREFECT_API_URL, PREFECT_HOME and analytics off are set
            here).
        prefect: the ``prefect`` executable.

    Yields:
        The environment its clients and workers use, and the server's log file.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    environ = {**os.environ, "PREFECT_HOME": str(home / "home"), "PREFECT_API_URL": url,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true", **env}
    log = home / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"],
                                env=environ, cwd=home, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while not healthy(url):
            assert proc.poll() is None, f"prefect server exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"prefect server not healthy in {START_S} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield environ, log
    finally:
        stop_group(proc)
