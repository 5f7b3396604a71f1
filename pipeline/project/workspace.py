"""One pipeline run per workspace: a second flow run or profile switch in the checkout is refused at once (DVC
would fail it with "Unable to acquire lock", and its ``--profile`` would rewrite params.yaml under the first).
The same lock on another file keeps one run of a sweep (flows/sweep.py) and, waiting its turn, one registration
per MLflow store (pipeline/register.py)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.core.errors import PipelineError

log = logging.getLogger(__name__)

LOCK_NAME = Path(".dvc") / "tmp" / "nmt-pipeline.lock"
RUN_REMEDY = "wait for it to end or stop it, or run in another clone"


@contextmanager
def exclusive_run(repo: str | Path, what: str, remedy: str = RUN_REMEDY, lock: Path = LOCK_NAME,
                  wait_s: float = 0.0) -> Iterator[None]:
    """Hold the pipeline lock of checkout ``repo`` (or the file ``lock``, relative to ``repo`` or absolute) for the
    ``with`` block, recording ``what`` holds it; another run holding it is waited for up to ``wait_s`` seconds, then
    a PipelineError naming the holder and ``remedy``."""
    path = Path(repo) / lock
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _acquire(fd, path, wait_s):
            busy = "another pipeline run holds this workspace" if lock == LOCK_NAME else "another run holds it"
            waited = f" after waiting {wait_s:g} s" if wait_s else ""
            raise PipelineError(f"{path}: {busy}{waited} ({_holder(fd)}); {remedy}")
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 "what": what}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, path: Path, wait_s: float) -> bool:
    """Lock ``fd``, trying every 0.2 s for up to ``wait_s`` seconds; False while another process holds it."""
    deadline, waiting = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            if not waiting:
                log.info("%s: held by %s; waiting up to %.0f s for it", path, _holder(fd), wait_s)
                waiting = True
            time.sleep(0.2)


def _holder(fd: int) -> str:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict) or "pid" not in data:
        return "holder unknown"
    return f"pid {data['pid']}, since {data.get('started', '?')}, {data.get('what', '')}".rstrip(", ")
