"""A pytest plugin: no process a test session started outlives the session, however it ends.

Tests start stages, torchrun jobs, ``dvc repro`` and servers in their own sessions or process groups, so
Ctrl-C or SIGTERM of pytest does not reach them. Every process started during the session inherits
:data:`MARK` in its environment (set at configure); when the session ends (normally, on Ctrl-C, or on
SIGTERM, which this plugin turns into a KeyboardInterrupt so that pytest's teardown runs), every live process
on the machine carrying this session's mark is sent SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from types import FrameType

import pytest

MARK = "NMT_TEST_SESSION"
GRACE_S = 3.0


def session_processes(token: str) -> list[int]:
    """Pids of live processes (not this one, not zombies) whose environment holds ``MARK=token``."""
    needle = f"{MARK}={token}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if needle in (entry / "environ").read_bytes() + b"\0":
                found.append(int(entry.name))
        except (OSError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return found


def end_session_processes(token: str, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every process of the session, SIGKILL what is left after ``grace_s``; returns what was found."""
    found = session_processes(token)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_processes(token):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while session_processes(token) and time.monotonic() < deadline:
            time.sleep(0.05)
    return found


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """Mark the session's environment, and let SIGTERM end the session the way Ctrl-C does."""
    if os.environ.get(MARK):  # a pytest run inside a test (or a worker of this session): the session reaps
        config._nmt_reaper_token = None  # noqa: SLF001
        return
    config._nmt_reaper_token = os.environ[MARK] = uuid.uuid4().hex  # noqa: SLF001
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_unconfigure(config: pytest.Config) -> None:
    """End every process the session left behind."""
    token = getattr(config, "_nmt_reaper_token", None)
    if token:
        end_session_processes(token)
