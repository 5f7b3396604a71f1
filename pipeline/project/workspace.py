"""One pipeline run per workspace: a second flow run or profile switch in the checkout is refused at once (DVC
would fail it with "Unable to acquire lock", and its ``--profile`` would rewrite params.yaml under the first).
A profile switch also holds DVC's own repository lock (:func:`dvc_lock`), so it never runs beside a plain
``dvc repro``.
The same lock on another file keeps one run of a sweep (flows/sweep.py) and, waiting its turn, one registration
per MLflow store (pipeline/register.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import filelock
import psutil

from pipeline.core.errors import PipelineError
from pipeline.core.owned import discard

log = logging.getLogger(__name__)

LOCK_NAME = Path(".dvc") / "tmp" / "nmt-pipeline.lock"
RUN_REMEDY = "wait for it to end or stop it, or run in another clone"


@contextmanager
def exclusive_run(repo: str | Path, what: str, remedy: str = RUN_REMEDY, lock: Path = LOCK_NAME,
                  wait_s: float = 0.0) -> Iterator[None]:
    """Hold the pipeline lock of checkout ``repo`` (or the file ``lock``, relative to ``repo`` or absolute) for the
    ``with`` block, recording ``what`` holds it in ``<lock>.holder`` beside it (filelock's own lock file is not ours to
    write); another run holding it is waited for
    up to ``wait_s`` seconds, then a PipelineError naming the holder and ``remedy``."""
    path = Path(repo) / lock
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = path.with_name(path.name + ".holder")
    held = filelock.FileLock(path, preserve_lock_file=True)
    try:
        held.acquire(timeout=0)
    except filelock.Timeout:
        if wait_s > 0:
            log.info("%s: held by %s; waiting up to %.0f s for it", path, _holder(holder), wait_s)
        try:
            held.acquire(timeout=wait_s, poll_interval=0.2)
        except filelock.Timeout:
            busy = "another pipeline run holds this workspace" if lock == LOCK_NAME else "another run holds it"
            waited = f" after waiting {wait_s:g} s" if wait_s else ""
            raise PipelineError(f"{path}: {busy}{waited} ({_holder(holder)}); {remedy}") from None
    try:
        holder.write_text(json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                      "what": what}), encoding="utf-8")
        yield
    finally:
        discard(holder)
        held.release()


def _holder(path: Path) -> str:
    try:
        data = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict) or "pid" not in data:
        return "holder unknown"
    return f"pid {data['pid']}, since {data.get('started', '?')}, {data.get('what', '')}".rstrip(", ")


#: DVC's repository lock: a DVC command holds it while it reads the workspace and writes dvc.lock (not while a
#: stage's command runs: then it holds DVC's rwlock on the stage's deps, params.yaml among them).
DVC_LOCK = Path(".dvc") / "tmp" / "lock"
_BLOCKER = re.compile(r"\(PID (\d+)\): (.*)")


@contextmanager
def dvc_lock(repo: str | Path, writes: list[str], remedy: str) -> Iterator[None]:
    """Hold DVC's own locks of checkout ``repo`` for the ``with`` block, taken as a DVC command takes them
    (dvc/lock.py, dvc/rwlock.py): the repository lock (what ``Repo.lock`` holds), then the rwlock for writing the files
    ``writes`` (relative to ``repo``), so no ``dvc repro`` reads them or writes dvc.lock meanwhile. A DVC command
    started in the block waits DVC's 3 s, then fails with DVC's "Unable to acquire lock". Nothing is held in a
    checkout without ``.dvc/config`` (not a DVC project).

    Raises:
        PipelineError: a DVC command holds the lock (after DVC's 3 s), or its running stage reads one of ``writes``;
            its pid and command named, and ``remedy``.
    """
    root = Path(repo)
    if not (root / ".dvc" / "config").is_file():
        yield
        return
    from dvc.config import Config
    from dvc.fs import localfs
    from dvc.lock import LockError, make_lock
    from dvc.rwlock import rwlock

    # As Repo.__init__ builds its lock (dvc/repo/__init__.py), without the git repository a Repo also needs.
    tmp, hardlink = root / ".dvc" / "tmp", Config(dvc_dir=str(root / ".dvc"))["core"].get("hardlink_lock", False)
    lock = make_lock(str(tmp / "lock"), tmp_dir=str(tmp), hardlink_lock=hardlink)
    try:
        lock.lock()
    except LockError:
        raise PipelineError(f"{root / DVC_LOCK}: a DVC command holds this checkout "
                            f"({_dvc_holder(root / DVC_LOCK)}); {remedy}") from None
    try:
        with contextlib.ExitStack() as held:
            paths = [localfs.join(localfs.abspath(str(root)), name) for name in writes]
            try:
                held.enter_context(rwlock(str(tmp), localfs, " ".join(sys.argv), [], paths, hardlink))
            except LockError as exc:
                match = _BLOCKER.search(str(exc))
                holder = f"pid {match[1]}: {match[2][:120]}" if match else "holder unknown"
                raise PipelineError(f"{root / '.dvc' / 'tmp' / 'rwlock'}: a running DVC stage reads "
                                    f"{', '.join(writes)} ({holder}); {remedy}") from None
            yield
    finally:
        lock.unlock()


def _dvc_holder(path: Path) -> str:
    """``pid N: its command line``, from the pid zc.lockfile writes into DVC's lock."""
    try:
        pid = int(path.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return "holder unknown"
    try:
        cmdline = psutil.Process(pid).cmdline()
    except psutil.Error:
        return f"pid {pid}"
    shown = " ".join(Path(part).name if i == 0 else part for i, part in
                     enumerate(arg for arg in cmdline if arg))
    return f"pid {pid}: {shown[:120]}"
