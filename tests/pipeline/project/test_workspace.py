"""The workspace lock (pipeline/project/workspace.py): refused at once by default, waited for when asked, refused in
one line naming the holder when the wait runs out."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pipeline.core.errors import PipelineError
from pipeline.project.workspace import exclusive_run
from tests.helpers.lockholder import hold_lock


def test_a_waiting_run_takes_the_lock_when_the_holder_ends_and_a_short_wait_is_refused(tmp_path: Path) -> None:
    lock = tmp_path / "store.db.lock"
    holder = hold_lock(tmp_path, "register x", lock)
    acquired = threading.Event()

    def wait_for_it() -> None:
        with exclusive_run(tmp_path, "register y", lock=lock, wait_s=120):
            acquired.set()

    waiter = threading.Thread(target=wait_for_it)
    try:
        with pytest.raises(PipelineError) as refused:
            with exclusive_run(tmp_path, "register z", "wait for it to end or stop it", lock=lock, wait_s=0.5):
                pass
        since = str(refused.value).split("since ")[1].split(",")[0]
        assert str(refused.value) == (f"{lock}: another run holds it after waiting 0.5 s (pid {holder.pid}, since "
                                      f"{since}, register x); wait for it to end or stop it")
        waiter.start()
        assert not acquired.wait(1.0)  # still held
    finally:
        holder.communicate("", timeout=30)
    waiter.join(timeout=60)
    assert acquired.is_set()
