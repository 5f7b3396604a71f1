"""Which process holds something open (an MLflow run, a staging folder), so that a later run can tell whether that
process has ended: a run a SIGKILLed process left RUNNING is ended (pipeline/tracking/runs.py), its staging
folder deleted."""

from __future__ import annotations

import os
import socket

import psutil


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (a zombie, killed but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's live process
        return True


def _start_time(pid: int) -> str:
    """The start time of process ``pid`` in hundredths of a second since the epoch (psutil's ``create_time``);
    empty when it cannot be read."""
    try:
        return str(round(psutil.Process(pid).create_time() * 100))
    except psutil.Error:
        return ""


def owner() -> str:
    """This process as a run's owner: ``<host>/<pid>/<start>``."""
    pid = os.getpid()
    return f"{socket.gethostname()}/{pid}/{_start_time(pid)}"


def owner_gone(value: str) -> bool:
    """Whether ``value``, an :func:`owner`, names an ended (or zombie, or reused) process of this host."""
    host, _, rest = value.partition("/")
    pid_text, _, start = rest.partition("/")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    return not pid_alive(pid) or bool(start) and _start_time(pid) not in ("", start)

