"""Worker process pools of the data stages (clean, encode): how many, how to start them, one error when they cannot.

Both stages run ``NMT_DATA_WORKERS`` processes (default ``os.cpu_count()``; 1 runs the work in the stage's
own process), read from :mod:`pipeline.core.env`.

The pools use multiprocessing's forkserver (no fork of a process that may hold tracking threads). The
forkserver listens on a Unix socket at ``<temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX``
(``multiprocessing.util.get_temp_dir``, ``multiprocessing.connection.arbitrary_address``), and Linux
limits a socket path to 107 bytes (``sun_path``, see unix(7)): under a long ``TMPDIR`` the pool would die
with "AF_UNIX path too long". That is refused up front, naming the variable and the ways out.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import tempfile
from collections.abc import Sequence

from pipeline.core import env
from pipeline.core.errors import ConfigError

SOCKET_PATH_MAX = 107
#: ``/pymp-`` + 8 characters + ``/listener-`` + 8 characters after the temp dir.
SOCKET_SUFFIX = len("/pymp-12345678/listener-12345678")


def data_workers() -> int:
    """Worker processes of a data stage: ``NMT_DATA_WORKERS`` or ``os.cpu_count()``.

    Raises:
        ConfigError: a malformed ``NMT_*`` variable (named, with what is expected).
    """
    return env.settings().data_workers or os.cpu_count() or 1


def check_temp_dir() -> None:
    """Refuse a temp dir whose forkserver socket path would not fit.

    Raises:
        ConfigError: naming ``TMPDIR``, its length, the limit and ``NMT_DATA_WORKERS=1``.
    """
    folder = tempfile.gettempdir()
    size = len(os.fsencode(folder))
    if size + SOCKET_SUFFIX > SOCKET_PATH_MAX:
        raise ConfigError("environment", [
            f"TMPDIR={folder} is {size} bytes long: the worker processes' socket under it would pass Linux's "
            f"{SOCKET_PATH_MAX}-byte limit; set TMPDIR to a folder of at most {SOCKET_PATH_MAX - SOCKET_SUFFIX} "
            f"bytes (e.g. /tmp), or NMT_DATA_WORKERS=1 (no worker processes)"])


def process_pool(workers: int, preload: Sequence[str]) -> cf.ProcessPoolExecutor:
    """A pool of ``workers`` forkserver processes that import ``preload`` once, before forking.

    Raises:
        ConfigError: the temp dir is too long for the forkserver's socket (:func:`check_temp_dir`).
    """
    check_temp_dir()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
