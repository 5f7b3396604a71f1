"""Fault injection for the crash-recovery tests: named points in training that can kill, crash or stall.

Unset (the normal case) every :func:`hit` is one environment lookup and returns. Set::

    NMT_FAULT_POINT=<point>:<step>[:<action>[:<rank>]]     e.g. mid_save:4  or  collective:3:stall:1
    NMT_FAULT_ONCE=<file>       fire only if <file> does not exist (it is created just before firing),
                                so a job restarted by torchrun does not hit the same fault again

Points (``step`` is the optimizer step being run or just finished):
    preflight      inside the pre-flight forward/backward on the largest batch shape (step 0)
    forward        before each micro-batch's forward of ``step``
    mid_accum      between two micro-batches of ``step`` (gradients partly accumulated)
    collective     before the gradient all-reduce of ``step``
    before_save    rank 0, before checkpoint ``step`` is written
    mid_save       rank 0, after ``model.pt`` of checkpoint ``step``, before optim.pt/state.json/DONE
    after_save     rank 0, after checkpoint ``step`` has its DONE marker, before older ones are pruned
    after_step     after ``step`` completed (validation and checkpoint included)
Actions: ``kill`` (SIGKILL this process, the default), ``exit`` (die at once with exit code 3),
``stall`` (sleep forever: a hung rank), ``oom`` (raise ``torch.OutOfMemoryError``). ``rank``
restricts the fault to one rank (default: every rank that reaches the point).
``NMT_FAULT_KILL_AT_STEP=<n>`` is the older spelling of ``after_step:<n>``.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

ENV, ONCE_ENV, LEGACY_ENV = "NMT_FAULT_POINT", "NMT_FAULT_ONCE", "NMT_FAULT_KILL_AT_STEP"
POINTS = ("preflight", "forward", "mid_accum", "collective", "before_save", "mid_save", "after_save", "after_step")
ACTIONS = ("kill", "exit", "stall", "oom")
EXIT_CODE = 3


@dataclass(frozen=True)
class Fault:
    """One parsed ``NMT_FAULT_POINT``."""

    point: str
    step: int
    action: str = "kill"
    rank: int | None = None


@functools.lru_cache(maxsize=8)
def parse(spec: str) -> Fault:
    """Parse ``<point>:<step>[:<action>[:<rank>]]``.

    Raises:
        ConfigError: naming ``NMT_FAULT_POINT``, the bad part and the accepted values.
    """
    parts = spec.strip().split(":")
    problems = []
    if not 2 <= len(parts) <= 4:
        problems.append(f"{ENV}={spec!r}: expected <point>:<step>[:<action>[:<rank>]]")
    else:
        if parts[0] not in POINTS:
            problems.append(f"{ENV}={spec!r}: unknown point {parts[0]!r}; one of {', '.join(POINTS)}")
        if len(parts) > 2 and parts[2] not in ACTIONS:
            problems.append(f"{ENV}={spec!r}: unknown action {parts[2]!r}; one of {', '.join(ACTIONS)}")
        for label, raw in (("step", parts[1]), ("rank", parts[3] if len(parts) > 3 else "0")):
            if not raw.isdigit():
                problems.append(f"{ENV}={spec!r}: {label} {raw!r} is not a non-negative integer")
    if problems:
        raise ConfigError("environment", problems)
    return Fault(point=parts[0], step=int(parts[1]), action=parts[2] if len(parts) > 2 else "kill",
                 rank=int(parts[3]) if len(parts) > 3 else None)


def active() -> Fault | None:
    """The fault configured in the environment, or None (the normal case)."""
    spec = os.environ.get(ENV)
    if spec:
        return parse(spec)
    legacy = os.environ.get(LEGACY_ENV)
    if legacy and legacy != "0":
        return parse(f"after_step:{legacy}")
    return None


def hit(point: str, step: int, rank: int = 0) -> None:
    """Fire the configured fault if it names ``point`` at ``step`` (and this ``rank``); else return."""
    if not (os.environ.get(ENV) or os.environ.get(LEGACY_ENV)):
        return
    fault = active()
    if fault is None or fault.point != point or fault.step != step or fault.rank not in (None, rank):
        return
    once = os.environ.get(ONCE_ENV)
    if once:
        marker = Path(once)
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return
    _fire(fault, rank)


def _fire(fault: Fault, rank: int) -> None:
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
