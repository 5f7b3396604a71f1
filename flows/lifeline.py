"""A lifeline between a flow and the process tree it starts: the tree ends when the flow does.

``python -m flows.lifeline --parent PID --grace S -- CMD ...`` runs ``CMD`` as its child and waits
for it, forwarding its exit code. It is meant to be started as the leader of a new session
(``start_new_session=True``), so that ``CMD`` and everything ``CMD`` starts share its process group,
and a terminal's Ctrl-C to the flow's group does not reach them directly: the flow decides when
they stop.

When the parent ``PID`` dies, however it dies (SIGKILL, the OOM killer, a lost node agent), the
kernel sends this process SIGTERM (``PR_SET_PDEATHSIG``, Linux, ``prctl(2)``); it then sends SIGTERM
to its whole group, waits ``--grace`` seconds for it to end (a checkpoint being written completes or
is left incomplete without its ``DONE`` marker, which the loader ignores), and SIGKILLs what is left.
A parent that died before the lifeline armed that is caught by comparing ``os.getppid()`` with
``PID``. While the parent lives, a SIGTERM or SIGINT here is left to the parent, which signals the
whole group itself (:func:`flows.dvc_task.kill_group`): the child then ends and so does the lifeline.

Plain Python with no imports beyond the standard library: it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1


def arm(parent: int) -> bool:
    """Ask for SIGTERM when the parent dies; return False when ``parent`` is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: only the getppid check below
        pass
    return os.getppid() == parent


def _group_members_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` other than this one is alive (zombies count as ended)."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def end_group(child: subprocess.Popen[bytes] | None, grace_s: float) -> None:
    """SIGTERM this process's group (itself excepted), wait up to ``grace_s``, then SIGKILL the rest."""
    pgid = os.getpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if child is not None:
            child.poll()
        if not _group_members_alive(pgid):
            return
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)  # ends this process too


def run(cmd: list[str], *, parent: int, grace_s: float) -> int:
    """Run ``cmd`` tied to ``parent``; return its exit code (``128 + signal`` when a signal ended it)."""
    orphaned = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal orphaned
        if os.getppid() != parent:  # the flow died: its death signal, or a stop that came after
            orphaned = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if not arm(parent):
        return 128 + signal.SIGTERM  # the flow is gone before anything started
    child = subprocess.Popen(cmd)
    while child.poll() is None:
        if orphaned or os.getppid() != parent:
            end_group(child, grace_s)
            break
        try:
            child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    code = child.wait()
    return code if code >= 0 else 128 - code


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
