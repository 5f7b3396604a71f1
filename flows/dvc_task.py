"""Run one ``dvc`` command as a subprocess in its own process group, streaming its output.

Killing only the direct child leaves torchrun workers (grandchildren) running, so the command is
started with ``start_new_session=True`` and the whole group is ended (SIGTERM, a grace period,
then SIGKILL) when it times out, when the caller is interrupted (Prefect's SIGTERM bridge raises
``TerminationSignal`` in the waiting thread, Ctrl-C raises ``KeyboardInterrupt``), and when the
leader exits while members of its group are still alive. The group's leader is a
:mod:`flows.lifeline`, so the group also ends when this process dies without a chance to clean up
(SIGKILL). No Prefect import here: the module is plain Python and testable on its own.

``python -m flows.dvc_task repro STAGE [--force]`` (:func:`repro_command`) is ``dvc repro --single-item
STAGE`` without DVC's reminder to ``git add dvc.lock`` after every stage: see :func:`repro`.
"""

from __future__ import annotations

import argparse
import errno
import logging
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from flows import lifeline

log = logging.getLogger(__name__)

TAIL_LINES = 20
_PROGRESS_EVERY_S = 10.0  # \r-terminated progress updates are logged at most this often

_live_groups: set[int] = set()
# Groups being stopped (an interrupt or a cancellation): what they print while they die (torchrun's
# shutdown warnings and traceback, DVC's) is kept in the result but no longer logged.
_stopping: set[int] = set()
_live_lock = threading.Lock()

PUBLISH_HINT = ("dvc.lock changed: to publish this run, commit it with its params and numbers: "
                "git add params.yaml dvc.lock metrics/ plots/ && git commit")

# What `dvc repro` prints (dvc/stage/run.py, dvc/stage/cache.py, dvc/stage/__init__.py, DVC 3.67).
_STATUS_PATTERNS: tuple[tuple[str, str], ...] = (
    ("ran", r"Running stage '{stage}'"),
    ("restored", r"Stage '{stage}' is cached - skipping run"),
    ("restored", r"Restored stage '{stage}' from run-cache"),
    ("skipped", r"Stage '{stage}' didn't change, skipping"),
)


@dataclass(frozen=True)
class ProcessResult:
    """What one command did.

    Attributes:
        args: the command line.
        returncode: exit status (negative: killed by that signal).
        duration_s: wall time from start to the group being gone.
        timed_out: the timeout fired and the group was killed.
        stdout_lines: every complete stdout line (DVC's own messages are short).
        stderr_tail: the last ``TAIL_LINES`` lines of stderr.
    """

    args: tuple[str, ...]
    returncode: int
    duration_s: float
    timed_out: bool
    stdout_lines: tuple[str, ...] = field(default=())
    stderr_tail: tuple[str, ...] = field(default=())


def stage_status(stage: str, stdout_lines: Sequence[str]) -> str:
    """Classify what ``dvc repro`` did with ``stage`` from its stdout.

    Returns:
        ``"ran"``, ``"restored"`` (from the run cache), ``"skipped"`` (unchanged) or ``"unknown"``.
    """
    text = "\n".join(stdout_lines)
    for status, pattern in _STATUS_PATTERNS:
        if re.search(pattern.format(stage=re.escape(stage)), text):
            return status
    return "unknown"


def live_process_groups() -> set[int]:
    """Process-group ids of commands started here that have not been reaped yet."""
    with _live_lock:
        return set(_live_groups)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a foreign process reused the id
        return False
    return True


def kill_group(pgid: int, proc: subprocess.Popen[bytes] | None = None, grace_s: float = 10.0) -> None:
    """SIGTERM the whole process group, wait up to ``grace_s``, then SIGKILL what is left.

    ``proc`` (the group leader, our child) is reaped while waiting, so its zombie does not keep the
    group looking alive.
    """
    def signal_group(sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    def wait_gone(limit_s: float) -> bool:
        deadline = time.monotonic() + limit_s
        while True:
            if proc is not None:
                proc.poll()
            if not _group_alive(pgid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    if proc is not None:
        proc.poll()
    if not _group_alive(pgid):
        return
    signal_group(signal.SIGTERM)
    if not wait_gone(grace_s):
        log.warning("process group %d still alive %.0f s after SIGTERM: sending SIGKILL", pgid, grace_s)
        signal_group(signal.SIGKILL)
        wait_gone(5.0)


def kill_all_groups(grace_s: float = 10.0) -> None:
    """End every process group started by :func:`run_in_group` that is still alive (its output no longer logged)."""
    for pgid in live_process_groups():
        with _live_lock:
            _stopping.add(pgid)
        kill_group(pgid, grace_s=grace_s)


def _visible(segment: bytes) -> str:
    """What a terminal would show for ``segment``: the text after its last carriage return."""
    return segment.rstrip(b"\r").rsplit(b"\r", 1)[-1].decode("utf-8", "replace")


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
                 timeout_s: float | None = None, grace_s: float = 10.0,
                 logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None) -> ProcessResult:
    """Run ``args`` in a new session, log each output line, kill the whole group on timeout or interrupt.

    Args:
        args: command line, e.g. ``["dvc", "repro", "--single-item", "train"]``.
        cwd: working directory.
        env: full environment of the child (default: this process's).
        timeout_s: wall-clock limit; ``None`` or ``<= 0`` means none.
        grace_s: seconds between SIGTERM and SIGKILL when the group is ended.
        logger: where stdout/stderr lines go (INFO); default this module's logger.

    Returns:
        The :class:`ProcessResult`. Any exception raised while waiting (``TerminationSignal``,
        ``KeyboardInterrupt``) propagates after the group is gone; what the group prints from then on
        is not logged (a stopped training's shutdown warnings, DVC's own lines).

    Raises:
        FileNotFoundError: the executable does not exist.
    """
    out = logger or log
    stdout_lines: list[str] = []
    stderr_tail: deque[str] = deque(maxlen=TAIL_LINES)
    group: list[int] = []  # the group's id, once started

    def on_stdout(line: str) -> None:
        stdout_lines.append(line)
        if line.strip() and group[0] not in _stopping:
            out.info("%s", line)

    def on_stderr(line: str) -> None:
        if line.strip():
            stderr_tail.append(line)
            if group[0] not in _stopping:
                out.info("%s", line)

    start = time.monotonic()
    if shutil.which(args[0], path=(env or os.environ).get("PATH")) is None:
        raise FileNotFoundError(errno.ENOENT, "command not found", args[0])
    proc = subprocess.Popen(lifeline.command(list(args), parent=os.getpid(), grace_s=grace_s), cwd=cwd,
                            env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    pgid = proc.pid  # a new session's leader: its pid is the group id
    group.append(pgid)
    with _live_lock:
        _live_groups.add(pgid)
    readers = [threading.Thread(target=_pump, args=(s, f), daemon=True, name=f"pump-{pgid}")
               for s, f in ((proc.stdout, on_stdout), (proc.stderr, on_stderr))]
    for t in readers:
        t.start()
    timed_out = False
    deadline = start + timeout_s if timeout_s and timeout_s > 0 else None
    try:
        while proc.poll() is None:
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                timed_out = True
                out.error("timed out after %.0f s: killing process group %d", timeout_s, pgid)
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
    except BaseException:  # Ctrl-C, SIGTERM, cancellation: the flow says it stopped, in one line
        with _live_lock:
            _stopping.add(pgid)
        raise
    finally:
        # Reached on normal exit (leftover group members), timeout, and any interrupt.
        kill_group(pgid, proc, grace_s=grace_s)
        proc.wait()
        for t in readers:
            t.join(timeout=5.0)
        with _live_lock:
            _live_groups.discard(pgid)
            _stopping.discard(pgid)
    return ProcessResult(args=tuple(args), returncode=proc.returncode, duration_s=time.monotonic() - start,
                         timed_out=timed_out, stdout_lines=tuple(stdout_lines), stderr_tail=tuple(stderr_tail))


def repro_command(stage: str, *, force: bool = False) -> list[str]:
    """The command line that reproduces ``stage`` alone, as ``dvc repro --single-item STAGE [--force]``,
    without DVC's ``git add`` reminder (:func:`repro`); its output has the lines :func:`stage_status` reads."""
    return [sys.executable, "-m", "flows.dvc_task", "repro", stage, *(["--force"] if force else [])]


def repro(stage: str, *, force: bool = False, root: str | Path = ".") -> int:
    """Reproduce ``stage`` alone through DVC's API (what ``dvc repro --single-item`` calls); 0 on success.

    DVC ends every command that rewrote ``dvc.lock`` with "To track the changes with git, run: git add
    dvc.lock ... To enable auto staging, run: dvc config core.autostage true" (``SCMContext`` in
    dvc/repo/scm_context.py) unless its ``quiet`` is set. A flow runs one ``dvc repro`` per stage, so the
    reminder came once per stage, and it names dvc.lock, which this repository commits only to publish a
    run. Setting ``quiet`` is what DVC's own experiment executor does for its runs
    (dvc/repo/experiments/executor/base.py); the flow says once at the end what to commit
    (:data:`PUBLISH_HINT`, :func:`publish_hint`). DVC's log lines (``Running stage``...) still print.

    Returns:
        0, or 255 after DVC's one-line ``ERROR:`` (the exit status of ``dvc`` for a DVC error).
    """
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    from dvc.ui import ui

    ui.enable()
    try:
        with Repo(str(root)) as dvc:
            dvc.scm_context.quiet = True
            dvc.reproduce(stage, single_item=True, force=force)
    except DvcException:
        logging.getLogger("dvc").exception("")  # DVC's handler: one "ERROR: ..." line, as `dvc` prints
        return 255
    return 0


def publish_hint(repo: str | Path) -> str | None:
    """:data:`PUBLISH_HINT` when git sees ``dvc.lock`` in ``repo`` as new or changed, else None."""
    done = subprocess.run(["git", "status", "--porcelain", "--", "dvc.lock"], cwd=repo, capture_output=True,
                          text=True, check=False)
    return PUBLISH_HINT if done.returncode == 0 and done.stdout.strip() else None


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.dvc_task repro STAGE [--force]``: see :func:`repro`."""
    parser = argparse.ArgumentParser(prog="python -m flows.dvc_task",
                                     description="dvc repro --single-item STAGE, without DVC's git-add reminder")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("repro", help="reproduce one stage of dvc.yaml in the current folder")
    rep.add_argument("stage", help="the dvc.yaml stage")
    rep.add_argument("--force", action="store_true", help="run it even if nothing changed (dvc repro --force)")
    args = parser.parse_args(argv)
    return repro(args.stage, force=args.force)


if __name__ == "__main__":
    sys.exit(main())
