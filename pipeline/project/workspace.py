"""One pipeline run per workspace: a second flow run, or a profile switch, in the same checkout is refused at once.

DVC allows one ``dvc`` process per repository at a time and fails the second with "Unable to acquire
lock", which the flow would take for a failed stage and retry for minutes; and a second run's
``--profile`` (or an ``nmt profile NAME``) would rewrite ``params.yaml`` under the first, and ``dvc.lock`` would
then record one profile's stages under another's params. So the flow and the profile switch take an exclusive
``flock(2)`` on ``<repo>/.dvc/tmp/nmt-pipeline.lock`` before it touches anything and holds it to the
end. The kernel drops the lock when the holder dies, however it dies, so a killed run never leaves
a stale lock behind. Deployments get the same guarantee across machines from their work pool's
concurrency limit and a fresh clone per run (``prefect.yaml``).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.core.errors import PipelineError

LOCK_NAME = Path(".dvc") / "tmp" / "nmt-pipeline.lock"
RUN_REMEDY = "wait for it to end or stop it, or run in another clone"


@contextmanager
def exclusive_run(repo: str | Path, what: str, remedy: str = RUN_REMEDY) -> Iterator[None]:
    """Hold the workspace's pipeline lock for the ``with`` block.

    Args:
        repo: the project checkout.
        what: what holds it, recorded in the lock file for the refusal message (e.g. the flow run id).
        remedy: what the refusal tells the user to do.

    Raises:
        PipelineError: another run holds the lock (its pid, start time and description are named).
    """
    path = Path(repo) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PipelineError(f"{path}: another pipeline run holds this workspace ({_holder(fd)}); "
                                f"{remedy}") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 "what": what}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict) or "pid" not in data:
        return "holder unknown"
    return f"pid {data['pid']}, since {data.get('started', '?')}, {data.get('what', '')}".rstrip(", ")
