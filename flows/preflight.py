"""What the flows' ``main`` does before it starts anything: refuse the params the run would use, and have
Prefect log an expected failure (a :class:`~pipeline.core.errors.PipelineError`) without its traceback."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.core.config import load_params
from pipeline.core.errors import PipelineError
from pipeline.project.profiles import check_profile, merged_profile


class _NoTracebackForPipelineErrors(logging.Filter):
    """Prefect logs a failed task's and flow's exception with its traceback; a PipelineError (a stage's one-line
    error, a refusal) is its message alone, which ``main`` prints last."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], PipelineError):
            record.exc_info = record.exc_text = None
        return True


def check_params_first(root: Path, profile: str | None) -> None:
    """Refuse the params the run would use (profile ``profile``'s, else ``root``'s params.yaml) before any server
    or DVC command: a ``paths.*`` value DVC cannot handle fails inside DVC with no reason given (``failed to
    reproduce 'clean': ``), before the stage's own check could run.

    Raises:
        ConfigError: no such profile, or the params do not validate (one line naming the key).
    """
    if profile is not None:
        merged_profile(check_profile(profile, root, "--profile"), root)
    elif (root / "params.yaml").is_file():
        load_params(root / "params.yaml")


def quiet_prefect_tracebacks() -> None:
    """Log a PipelineError that fails a task or flow run without its traceback (the loggers of Prefect's run
    engines, ``prefect.task_runs`` and ``prefect.flow_runs``); any other exception keeps its traceback."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForPipelineErrors) for f in logger.filters):
            logger.addFilter(_NoTracebackForPipelineErrors())
