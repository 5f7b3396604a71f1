"""The train stage's tie to what started it: under a bare ``dvc repro`` the torchrun agent ends when the dvc
process dies."""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

import psutil

log = logging.getLogger(__name__)

#: What DVC runs a stage's ``cmd`` through (``$SHELL -c``, dvc/stage/run.py) when the shell does not exec it.
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "fish", "ksh", "mksh"})


def _proc_field(pid: int, name: str) -> str:
    """``comm`` (the process name) or the parent pid (``ppid``) of ``pid``; "" when it is gone."""
    try:
        proc = psutil.Process(pid)
        return proc.name() if name == "comm" else str(proc.ppid())
    except psutil.Error:
        return ""


def _end_when_gone(pid: int) -> None:
    """Wait for ``pid`` to exit (a pidfd, else polling), then SIGTERM this agent: torchrun stops its ranks."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    except OSError:  # no pidfd (Linux < 5.3): poll
        while _proc_field(pid, "comm"):
            time.sleep(0.5)
        fd = None
    if fd is not None:
        select.select([fd], [], [])
    log.error("stage train: the dvc process (pid %d) that started this training is gone: stopping it", pid)
    os.kill(os.getpid(), signal.SIGTERM)


def tie_to_dvc() -> None:
    """Under ``dvc repro`` (DVC sets ``DVC_STAGE`` for a stage's command), end this agent when the dvc process
    dies: its parent, or the parent of the ``$SHELL -c`` DVC ran the command with. A SIGKILLed dvc signals nobody,
    and the agent and its ranks would train on beside the next run. ``nmt run`` ties the whole stage to the flow
    already (flows/lifeline.py); this covers a bare ``dvc repro``."""
    if "DVC_STAGE" not in os.environ:
        return
    starter = os.getppid()
    if _proc_field(starter, "comm") in _SHELLS:
        starter = int(_proc_field(starter, "ppid") or 1)
    if starter <= 1:
        os.kill(os.getpid(), signal.SIGTERM)  # already orphaned: nothing has started yet
    threading.Thread(target=_end_when_gone, args=(starter,), daemon=True, name="tie-to-dvc").start()
