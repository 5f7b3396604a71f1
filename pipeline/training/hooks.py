"""Named points in training where a test may inject a fault (:mod:`pipeline.training.faults`).

The loop, the checkpoint writer and the memory pre-flight call ``hooks.at(point, step, rank)``; the
default :class:`Hooks` does nothing, so normal runs never know the points exist.
"""

from __future__ import annotations


class Hooks:
    """Called at each named point; this default does nothing."""

    def at(self, point: str, step: int, rank: int = 0) -> None:
        """Reached ``point`` of optimizer ``step`` on ``rank``."""
