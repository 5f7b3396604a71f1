"""Fault injection for the crash-recovery tests: named points in training that can kill, crash or stall.

``NMT_FAULT_POINT=<point>:<step>[:<action>[:<rank>]][@<file>]`` (e.g. ``collective:3:stall:1@/tmp/once``) fires
``action`` (default ``kill``) when ``rank`` reaches ``point`` at ``step``; with ``@<file>`` only while ``<file>``
does not exist (created before firing), so a job that torchrun restarts does not hit the fault again.
Points and actions: :data:`pipeline.core.env.FAULT_POINTS` and ``FAULT_ACTIONS``.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from pipeline.core import env
from pipeline.core.env import Fault

log = logging.getLogger(__name__)

ENV = "NMT_FAULT_POINT"
EXIT_CODE = 3


class Hooks:
    """Called at each named point; this default does nothing."""

    def at(self, point: str, step: int, rank: int = 0) -> None:
        """Reached ``point`` of optimizer ``step`` on ``rank``."""


class FaultHooks(Hooks):
    """Fires the fault configured in ``NMT_FAULT_POINT``."""

    def at(self, point: str, step: int, rank: int = 0) -> None:
        hit(point, step, rank)


def active() -> Fault | None:
    """The fault configured in the environment, or None (a malformed variable is a ConfigError)."""
    return env.settings().fault


def from_env() -> Hooks:
    """:class:`FaultHooks` when a fault is configured, else the no-op :class:`Hooks`."""
    return FaultHooks() if active() is not None else Hooks()


def hit(point: str, step: int, rank: int = 0) -> None:
    """Fire the configured fault if it names ``point`` at ``step`` (and this ``rank``); else return."""
    fault = env.settings().fault
    if fault is None or fault.point != point or fault.step != step or fault.rank not in (None, rank):
        return
    if fault.once is not None:
        try:
            fault.once.touch(exist_ok=False)
        except FileExistsError:
            return
    what = f"{ENV}={fault.point}:{fault.step}:{fault.action} on rank {rank} (fault-injection hook)"
    if fault.action == "oom":
        import torch

        raise torch.OutOfMemoryError(f"injected allocation failure: {what}")
    log.warning("%s: %s", what, {"kill": "SIGKILL", "exit": f"exit {EXIT_CODE}", "stall": "stalling"}[fault.action])
    for handler in logging.getLogger().handlers:
        handler.flush()
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "exit":
        os._exit(EXIT_CODE)
    while True:  # stall: a rank that never reaches its next collective
        time.sleep(3600)
