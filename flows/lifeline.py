"""The processes a flow starts, tied to its life: each command runs in its own process group under a lifeline.

Ours and not Prefect's: a Prefect task's timeout or cancellation raises in the task's thread and leaves the
processes it started running, a cancelled flow run's process is signalled alone (PrefectHQ/prefect#20979), and a
SIGKILLed flow signals nobody, so a stage's torchrun ranks (grandchildren) would outlive it.
``python -m flows.lifeline --parent PID --grace S -- CMD ...`` leads a new session; when ``PID`` dies the kernel
sends it SIGTERM (``PR_SET_PDEATHSIG``, ``prctl(2)``) and it ends its group: SIGTERM, a grace period, SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

log = logging.getLogger(__name__)

TAIL_LINES = 20
_PROGRESS_EVERY_S = 10.0  # \r-terminated progress updates are logged at most this often

_live_groups: set[int] = set()
# Groups being stopped (an interrupt or a cancellation): what they print while they die (torchrun's
# shutdown warnings and traceback, DVC's) is kept in the result but no longer logged.
_stopping: set[int] = set()
_live_lock = threading.Lock()

_PR_SET_PDEATHSIG = 1


def _wait_until(done: Callable[[], bool], limit_s: float = math.inf) -> bool:
    """Poll ``done`` every 50 ms for up to ``limit_s`` seconds; whether it became true."""
    deadline = time.monotonic() + limit_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def kill_group(pgid: int, proc: subprocess.Popen[bytes] | None = None, grace_s: float = 10.0) -> None:
    """SIGTERM process group ``pgid``, wait up to ``grace_s`` (reaping ``proc``), then SIGKILL what is left."""
    def gone() -> bool:
        if proc is not None:
            proc.poll()
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):  # PermissionError: a foreign process reused the id
            return True
        return False

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if gone():
            return
        if sig == signal.SIGKILL:
            log.warning("process group %d still alive %.0f s after SIGTERM: sending SIGKILL", pgid, grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        _wait_until(gone, wait_s)


def _others_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` other than this one is alive (not a zombie)."""
    me = os.getpid()
    for proc in psutil.process_iter(["status"]):
        if proc.pid == me or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        with contextlib.suppress(OSError):  # gone meanwhile
            if os.getpgid(proc.pid) == pgid:
                return True
    return False


def _end_own_group(child: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM this process's group (itself excepted), wait up to ``grace_s``, then SIGKILL it, this one too."""
    pgid = os.getpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(pgid, signal.SIGTERM)
    if not _wait_until(lambda: child.poll() is not None and not _others_alive(pgid), grace_s):
        os.killpg(pgid, signal.SIGKILL)


def run(cmd: list[str], *, parent: int, grace_s: float) -> int:
    """Run ``cmd`` tied to ``parent``; its exit code (``128 + signal`` when a signal ended it)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: None)  # the wait below sees whether the parent is gone
    with contextlib.suppress(OSError, AttributeError):  # not Linux: only the getppid check
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        return 128 + signal.SIGTERM  # the flow is gone before anything started
    child = subprocess.Popen(cmd)
    _wait_until(lambda: child.poll() is not None or os.getppid() != parent)
    if child.poll() is None:
        _end_own_group(child, grace_s)
    code = child.wait()
    return code if code >= 0 else 128 - code


@dataclass(frozen=True)
class ProcessResult:
    """One command's exit status (negative: that signal), wall time, stdout lines and stderr's last lines."""

    args: tuple[str, ...]
    returncode: int
    duration_s: float
    stdout_lines: tuple[str, ...] = ()
    stderr_tail: tuple[str, ...] = ()


def kill_all_groups(grace_s: float = 10.0) -> None:
    """End every process group started by :func:`run_in_group` that is still alive (its output no longer logged)."""
    with _live_lock:
        groups = set(_live_groups)
        _stopping.update(groups)
    for pgid in groups:
        kill_group(pgid, grace_s=grace_s)


def _visible(segment: bytes) -> str:
    """What a terminal would show for ``segment``: the text after its last carriage return, colour codes gone."""
    return _ANSI.sub("", segment.rstrip(b"\r").rsplit(b"\r", 1)[-1].decode("utf-8", "replace"))


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # terminal colour and cursor sequences (ECMA-48 CSI)
#: A stage's own prefix (pipeline/core/console.py ``setup_logging``): the flow's logger adds time and level itself.
_STAGE_PREFIX = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def relay(logger: logging.Logger | logging.LoggerAdapter[logging.Logger], line: str) -> None:
    """Log a stage's output ``line`` once: at the stage's level, without its time and level prefix."""
    if match := _STAGE_PREFIX.match(line):
        logger.log(getattr(logging, match[1]), "%s", line[match.end():])
    else:
        logger.info("%s", line)


def _pump(stream: IO[bytes], emit: Callable[[str], None]) -> None:
    """Split ``stream`` into lines on \\n and emit each; \\r progress updates at most every 10 s."""
    buf = b""
    last_progress = 0.0
    while chunk := stream.read1(65536):  # type: ignore[attr-defined]
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            emit(_visible(line))
        if b"\r" in buf.rstrip(b"\r"):
            head, _, buf = buf.rstrip(b"\r").rpartition(b"\r")
            buf = b"\r" + buf
            now = time.monotonic()
            if now - last_progress >= _PROGRESS_EVERY_S:
                last_progress = now
                emit(_visible(head))
    if buf.strip(b"\r"):
        emit(_visible(buf))
    stream.close()


def run_in_group(args: Sequence[str], *, cwd: str | Path, env: Mapping[str, str] | None = None,
                 grace_s: float = 10.0,
                 logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None) -> ProcessResult:
    """Run ``args`` in a new session under a lifeline, log each output line (INFO), end the whole group when done.

    ``env`` is the command's whole environment (default: this process's). An exception raised while waiting
    (Prefect's timeout or ``TerminationSignal``, ``KeyboardInterrupt``) propagates once the group is gone.
    """
    stdout_lines: list[str] = []
    stderr_tail: deque[str] = deque(maxlen=TAIL_LINES)

    def keep(lines: list[str] | deque[str]) -> Callable[[str], None]:
        def emit(line: str) -> None:
            if line.strip():
                lines.append(line)
                if pgid not in _stopping:
                    relay(logger or log, line)
        return emit

    if shutil.which(args[0], path=(env or os.environ).get("PATH")) is None:
        raise FileNotFoundError(errno.ENOENT, "command not found", args[0])
    start = time.monotonic()
    proc = subprocess.Popen(command(list(args), parent=os.getpid(), grace_s=grace_s), cwd=cwd,
                            env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    pgid = proc.pid  # a new session's leader: its pid is the group id
    with _live_lock:
        _live_groups.add(pgid)
    readers = [threading.Thread(target=_pump, args=(s, f), daemon=True, name=f"pump-{pgid}")
               for s, f in ((proc.stdout, keep(stdout_lines)), (proc.stderr, keep(stderr_tail)))]
    for t in readers:
        t.start()
    try:
        _wait_until(lambda: proc.poll() is not None)  # in steps: Prefect's cancellation raises in this thread
    except BaseException:  # Ctrl-C, SIGTERM, a timeout, a cancellation: the flow says it stopped, in one line
        with _live_lock:
            _stopping.add(pgid)
        raise
    finally:  # also on a normal exit: leftover members of the group
        kill_group(pgid, proc, grace_s=grace_s)
        proc.wait()
        for t in readers:
            t.join(timeout=5.0)
        with _live_lock:
            _live_groups.discard(pgid)
            _stopping.discard(pgid)
    return ProcessResult(args=tuple(args), returncode=proc.returncode, duration_s=time.monotonic() - start,
                         stdout_lines=tuple(stdout_lines), stderr_tail=tuple(stderr_tail))


def command(cmd: list[str], *, parent: int, grace_s: float) -> list[str]:
    """The command line that runs ``cmd`` under a lifeline to ``parent``."""
    return [sys.executable, "-m", "flows.lifeline", "--parent", str(parent), "--grace", f"{grace_s:g}", "--", *cmd]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.lifeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parent", type=int, required=True, help="pid whose death ends CMD's process group")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL (default 30)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command after --")
    return run(cmd, parent=args.parent, grace_s=args.grace)


if __name__ == "__main__":
    sys.exit(main())
