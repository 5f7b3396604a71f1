"""Which process holds something open (an MLflow run, a staging folder), so that a later run can tell whether that
process has ended: a run a SIGKILLed process left RUNNING is ended, its staging folder deleted."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import psutil

#: The run's owner: ``<host>/<pid>/<start>``.
OWNER_TAG = "nmt.owner"
#: The checkout (or sweep clone) the run belongs to, resolved.
CHECKOUT_TAG = "nmt.checkout"


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


def owner_tags(root: str | Path) -> dict[str, str]:
    """The tags that let a later run find this run if this process dies with it open."""
    return {OWNER_TAG: owner(), CHECKOUT_TAG: str(Path(root).resolve())}


def owner_gone(value: str) -> bool:
    """Whether the :data:`OWNER_TAG` ``value`` names an ended (or zombie, or reused) process of this host."""
    host, _, rest = value.partition("/")
    pid_text, _, start = rest.partition("/")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    return not pid_alive(pid) or bool(start) and _start_time(pid) not in ("", start)


def in_checkout(value: str, root: str | Path) -> bool:
    """Whether ``value`` (a :data:`CHECKOUT_TAG`) is ``root`` or a folder inside it (a sweep's clones)."""
    base = str(Path(root).resolve())
    return value == base or value.startswith(base.rstrip(os.sep) + os.sep)


def end_orphans(client: Any, experiment_id: str, root: str | Path,
                logger: logging.Logger | logging.LoggerAdapter) -> list[str]:
    """Mark ``KILLED`` the ``RUNNING`` runs of ``root`` whose owner is gone, logging each; return their ids."""
    ended: list[str] = []
    token = None
    while True:
        page = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=1000, page_token=token)
        for run in page:
            tags, run_id = run.data.tags, run.info.run_id
            if in_checkout(tags.get(CHECKOUT_TAG, ""), root) and owner_gone(tags.get(OWNER_TAG, "")):
                client.set_tag(run_id, "nmt.ended_by", "a later run: the process that held it open was gone")
                client.set_terminated(run_id, status="KILLED")
                logger.info("marked MLflow run %s (%s) KILLED: its process %s ended without closing it", run_id,
                            tags.get("mlflow.runName", "?"), tags[OWNER_TAG])
                ended.append(run_id)
        if not (token := page.token):
            return ended
