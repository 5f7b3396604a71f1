"""Interrupting pytest (SIGTERM, Ctrl-C) leaves no process a test started behind (tests/helpers/reaper.py), also
with pytest-xdist's workers (``make test``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import REPO
from tests.helpers.reaper import MARK

INNER = '''
import os, subprocess, time
from pathlib import Path

def test_starts_a_detached_process_and_hangs(tmp_path):
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)  # out of pytest's process group
    Path({pidfile!r} + ".tmp").write_text(f"{{proc.pid}} {{os.getpid()}}")  # and the (worker) process running it
    os.replace({pidfile!r} + ".tmp", {pidfile!r})
    time.sleep(300)
'''


# pytest as a terminal's foreground job: SIGINT not ignored. A shell's background job (and so a pytest started with
# `&` from a script) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
AS_FOREGROUND = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                 "os.execv(sys.executable, [sys.executable, '-m', 'pytest', *sys.argv[1:]])")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(("sig", "workers"), [
    pytest.param(signal.SIGTERM, 0, id="sigterm"), pytest.param(signal.SIGINT, 0, id="ctrl-c"),
    pytest.param(signal.SIGTERM, 2, id="sigterm-xdist", marks=pytest.mark.slow),  # two workers to start and end
    pytest.param(signal.SIGINT, 2, id="ctrl-c-xdist", marks=pytest.mark.slow)])
def test_an_interrupted_session_leaves_no_process_behind(tmp_path: Path, sig: signal.Signals, workers: int) -> None:
    pidfile = tmp_path / "pid"
    (tmp_path / "test_inner.py").write_text(INNER.format(pidfile=str(pidfile)), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != MARK}  # the inner session is a session of its own
    env["PYTHONPATH"] = str(REPO)
    inner = subprocess.Popen([sys.executable, "-c", AS_FOREGROUND, "-q", "-p", "no:cacheprovider", "-p",
                              "tests.helpers.reaper", "-n", str(workers), str(tmp_path / "test_inner.py")],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not pidfile.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pidfile.is_file(), inner.communicate(timeout=30)[0]
        pids = [int(p) for p in pidfile.read_text().split()]
        assert all(map(_alive, pids))
        if sig == signal.SIGINT:
            os.killpg(inner.pid, sig)  # Ctrl-C in a terminal: the foreground process group (pytest and its workers)
        else:
            inner.send_signal(sig)  # `kill PID`: pytest alone
        inner.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, pids)), "a process of the test outlived the interrupted session"
    finally:  # a failed check leaves nothing either
        with contextlib.suppress(ProcessLookupError):
            os.killpg(inner.pid, signal.SIGKILL)
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)
        inner.wait()
