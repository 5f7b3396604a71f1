"""One pipeline run per workspace: a second flow run or profile switch in the checkout is refused at once (DVC
would fail it with "Unable to acquire lock", and its ``--profile`` would rewrite params.yaml under the first).
The same lock on another file keeps one run of a sweep (flows/sweep.py)."""

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
def exclusive_run(repo: str | Path, what: str, remedy: str = RUN_REMEDY, lock: Path = LOCK_NAME) -> Iterator[None]:
    """Hold the pipeline lock of checkout ``repo`` (or the file ``lock``, relative to ``repo`` or absolute) for the
    ``with`` block, recording ``what`` holds it (a PipelineError naming the holder and ``remedy`` if another run
    holds it)."""
    path = Path(repo) / lock
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy = "another pipeline run holds this workspace" if lock == LOCK_NAME else "another run holds it"
            raise PipelineError(f"{path}: {busy} ({_holder(fd)}); {remedy}") from None
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
