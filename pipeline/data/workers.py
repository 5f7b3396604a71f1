"""Worker process pools of the data stages (clean, encode): ``NMT_DATA_WORKERS`` forkserver processes (no fork
of a process that may hold tracking threads)."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import tempfile
from collections.abc import Sequence

from pipeline.core import env
from pipeline.core.errors import ConfigError

SOCKET_PATH_MAX = 107  # sun_path, unix(7)
SOCKET_SUFFIX = len("/pymp-12345678/listener-12345678")  # multiprocessing.connection.arbitrary_address


def data_workers() -> int:
    """Worker processes of a data stage: ``NMT_DATA_WORKERS`` or ``os.cpu_count()`` (1: the stage's own process)."""
    return env.settings().data_workers or os.cpu_count() or 1


def check_temp_dir() -> None:
    """Raise a ConfigError naming ``TMPDIR`` when the forkserver's socket path under it would not fit."""
    folder = tempfile.gettempdir()
    size = len(os.fsencode(folder))
    if size + SOCKET_SUFFIX > SOCKET_PATH_MAX:
        raise ConfigError("environment", [
            f"TMPDIR={folder} is {size} bytes long: the worker processes' socket under it would pass Linux's "
            f"{SOCKET_PATH_MAX}-byte limit; set TMPDIR to a folder of at most {SOCKET_PATH_MAX - SOCKET_SUFFIX} "
            f"bytes (e.g. /tmp), or NMT_DATA_WORKERS=1 (no worker processes)"])


def process_pool(workers: int, preload: Sequence[str]) -> cf.ProcessPoolExecutor:
    """A pool of ``workers`` forkserver processes that import ``preload`` once (:func:`check_temp_dir` first)."""
    check_temp_dir()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
