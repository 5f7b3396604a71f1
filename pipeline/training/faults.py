"""Fault injection for the crash-recovery tests: named points in training that can kill, crash or stall.

The loop, the checkpoint writer and the memory pre-flight call ``hooks.at(point, step, rank)``; the default
:class:`Hooks` does nothing. With ``NMT_FAULT_POINT`` set (parsed and checked in :mod:`pipeline.core.env`)::

    NMT_FAULT_POINT=<point>:<step>[:<action>[:<rank>]][@<file>]   e.g. mid_save:4  or  collective:3:stall:1@/tmp/once

With ``@<file>`` the fault fires only if ``<file>`` does not exist (it is created just before firing), so a
job restarted by torchrun does not hit the same fault again; without it, every time the point is reached.

Points (``step`` is the optimizer step being run or just finished):
    preflight      inside the pre-flight forward/backward on the largest batch shape (step 0)
    forward        before each forward pass of ``step``
    mid_accum      between two forward passes of ``step`` (gradients partly accumulated)
    collective     before the gradient all-reduce of ``step``
    before_save    rank 0, before checkpoint ``step`` is written
    mid_save       rank 0, after ``model.pt`` of checkpoint ``step``, before optim.pt/state.json/DONE
    after_save     rank 0, after checkpoint ``step`` has its DONE marker, before older ones are pruned
    after_step     after ``step`` completed (validation and checkpoint included)
Actions: ``kill`` (SIGKILL this process, the default), ``exit`` (die at once with exit code 3),
``stall`` (sleep forever: a hung rank), ``oom`` (raise ``torch.OutOfMemoryError``). ``rank``
restricts the fault to one rank (default: every rank that reaches the point).
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
