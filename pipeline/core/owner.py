"""Which process holds an MLflow run open, and whether it still lives: how a run left RUNNING by a killed
process is told from one that is still running.

A run records its owner in a tag when it opens (``<host>/<pid>/<start>``, ``start`` being the process's
start time in clock ticks since boot, field 22 of ``/proc/<pid>/stat``, so a pid the kernel has since given
to another process does not count as the owner). SIGKILL runs no code, so nothing can end the run then;
the next pipeline run or sweep in the same checkout ends it (:func:`end_orphans`, called by
:func:`pipeline.core.tracking.end_orphaned_runs`). No mlflow here: the client is handed in.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

#: The run's owner: ``<host>/<pid>/<start>``.
OWNER_TAG = "nmt.owner"
#: The checkout (or sweep clone) the run belongs to, resolved.
CHECKOUT_TAG = "nmt.checkout"


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` from the third (the state) on; empty when it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return []
    return stat[stat.rfind(")") + 2:].split()  # the command name in (...) may hold spaces


def _start_ticks(pid: int) -> str:
    """The start time of process ``pid`` (``/proc/<pid>/stat`` field 22); empty when it cannot be read."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else ""


def owner() -> str:
    """This process as a run's owner: ``<host>/<pid>/<start>``."""
    pid = os.getpid()
    return f"{socket.gethostname()}/{pid}/{_start_ticks(pid)}"


def owner_tags(root: str | Path) -> dict[str, str]:
    """The tags that let a later run find this run if this process dies with it open."""
    return {OWNER_TAG: owner(), CHECKOUT_TAG: str(Path(root).resolve())}


def owner_gone(value: str) -> bool:
    """Whether the owner named by ``value`` (an :data:`OWNER_TAG`) is a process of this host that has ended.

    False when it is alive, on another host, or ``value`` is not an owner (a run opened elsewhere or by an
    older version is never taken for an orphan).
    """
    host, _, rest = value.partition("/")
    pid_text, _, start = rest.partition("/")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    fields = _stat(pid)
    if fields[:1] == ["Z"]:
        return True  # ended, not yet waited for by its parent
    return bool(start) and len(fields) > 19 and fields[19] != start  # the pid now names another process


def in_checkout(value: str, root: str | Path) -> bool:
    """Whether ``value`` (a :data:`CHECKOUT_TAG`) is ``root`` or a folder inside it (a sweep's clones)."""
    base = str(Path(root).resolve())
    return value == base or value.startswith(base.rstrip(os.sep) + os.sep)


def end_orphans(client: Any, experiment_id: str, root: str | Path,
                logger: logging.Logger | logging.LoggerAdapter) -> list[str]:
    """Mark ``KILLED`` every ``RUNNING`` run of the experiment that belongs to ``root`` (:func:`in_checkout`) and
    whose owner is gone (:func:`owner_gone`), logging one line each; runs of other hosts, of live processes or
    without the tags are left alone. ``client`` is an MLflow client. Returns the ids of the runs it ended."""
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
        token = page.token
        if not token:
            return ended
