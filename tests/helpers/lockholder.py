"""Another process holding a lock of pipeline/project/workspace.py, for tests of what waits for it or is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import REPO

_SCRIPT = ("import sys; from pathlib import Path; from pipeline.project.workspace import LOCK_NAME, exclusive_run\n"
           "with exclusive_run(sys.argv[1], sys.argv[2], lock=Path(sys.argv[3]) if sys.argv[3] else LOCK_NAME):\n"
           "    print('held', flush=True); sys.stdin.read()\n")


def hold_lock(repo: str | Path, what: str, lock: Path | None = None) -> subprocess.Popen:
    """A process holding ``repo``'s workspace lock (or the file ``lock``) as ``what`` until its stdin closes
    (``holder.communicate("")``); returns once it holds it."""
    holder = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(repo), what, str(lock or "")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    assert holder.stdout.readline() == "held\n"
    return holder
