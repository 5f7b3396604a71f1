"""What every stage shares: logging, params loading, the bookkeeping wrapper (:func:`stage_main`), one-line errors."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core import env, stages, tracking
from pipeline.core.config import Params, flatten, load_params, section_dict
from pipeline.core.errors import EXIT_PERMANENT, ConfigError, PermanentError, PipelineError
from pipeline.core.owned import write_text
from pipeline.core.write_errors import public_path, write_error

if TYPE_CHECKING:  # a stage that builds no record does not depend on pipeline/core/details.py
    from pipeline.core.details import StageDetails

log = logging.getLogger(__name__)


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"]+@")
_SECRET_ENV = re.compile(r"(?i)(PASSWORD|PASSWD|TOKEN|SECRET|CREDENTIAL|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY)")


def redact(text: str) -> str:
    """``text`` without URL userinfo or the value of an environment variable whose name says it is secret."""
    text = _USERINFO.sub(r"\1***@", text)
    for name, value in os.environ.items():
        if len(value) >= 6 and _SECRET_ENV.search(name) and value in text:
            text = text.replace(value, "***")
    return text


class RedactingFormatter(logging.Formatter):
    """A formatter whose output (message, traceback) goes through :func:`redact`."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def setup_logging() -> None:
    """Log to stderr with timestamps, credentials redacted, at ``NMT_LOG_LEVEL`` (INFO if malformed)."""
    try:
        level = env.settings().log_level
    except ConfigError:
        level = "INFO"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def stage_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every stage accepts (``--params``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    return parser


def arg_type(convert: Callable[[str], Any], ok: Callable[[Any], bool], must: str,
             width: int = 40) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert(text)`` if ``ok`` takes it, else ``<text>: must be <must>``."""
    def parse(text: str) -> Any:
        with contextlib.suppress(ValueError):
            if ok(value := convert(text)):
                return value
        raise argparse.ArgumentTypeError(f"{text:.{width}}: must be {must}")
    return parse


def os_error_message(exc: OSError) -> str:
    """One line for an OSError that escaped a stage: what failed on which path, and what to do."""
    path = public_path(os.fsdecode(exc.filename)) if exc.filename is not None else None
    disk_full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    if path is not None and disk_full:
        return str(write_error(exc, path))
    code = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    if path is None:
        hint = ("free space on the disk holding the outputs (or raise the quota or `ulimit -f`)" if disk_full
                else "see the log above")
        return f"{exc.strerror or exc} ({code}); {hint}, then rerun the stage"
    return (f"{path}: {exc.strerror or exc} ({code}); check that it exists and that this user may read and write it "
            "and its folder, then rerun the stage")


def run_cli(name: str, body: Callable[[Params, argparse.Namespace], None], argv: list[str] | None,
            parser: argparse.ArgumentParser | None = None) -> int:
    """Check the ``NMT_*`` environment, load params, run ``body``; return the exit code (a PipelineError or OSError
    becomes ``error: stage <name>: <message>`` and 1, a PermanentError :data:`EXIT_PERMANENT`, a bug also prints its
    traceback), credentials redacted."""
    setup_logging()
    parser = parser or stage_parser(f"pipeline stage {name}")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        env.settings()
        params = load_params(args.params)
        body(params, args)
    except PermanentError as exc:
        return _fail(name, str(exc), EXIT_PERMANENT)
    except PipelineError as exc:
        return _fail(name, str(exc))
    except OSError as exc:
        return _fail(name, os_error_message(exc))
    except KeyboardInterrupt:
        print(f"error: stage {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug or a library failure: keep the traceback, hide secrets
        print(redact(traceback.format_exc()), file=sys.stderr, end="")
        return _fail(name, f"unexpected {type(exc).__name__}: {exc}")
    log.info("stage %s finished in %.1f s", name, time.monotonic() - start)
    return 0


def _fail(name: str, message: str, code: int = 1) -> int:
    print(redact(f"error: stage {name}: {message}"), file=sys.stderr)
    return code


def write_metrics(path: str | Path, metrics: dict[str, object]) -> None:
    """Write a stage's metrics JSON atomically (sorted keys)."""
    write_text(path, json.dumps(metrics, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def run_stage(name: str, body: Callable[[], dict[str, object] | StageDetails], *, metrics_dir: str | Path,
              params: Params | None = None, root: str | Path = ".") -> dict[str, object]:
    """Run one stage's ``body`` with its bookkeeping (MLflow run, params, seconds; on rank 0 ``<stage>.json`` and
    ``<stage>.details.json``, logged with the stage's plots as artifacts) and return its details record."""
    spec = stages.get(name)
    active = os.environ.get("RANK", "0") in ("", "0")
    start = time.monotonic()
    monitor = active and tracking.system_metrics_wanted(name, env.settings().device, _cuda_available(name))
    with tracking.stage_run(name, root=root, active=active, system_metrics=monitor) as run:
        if params is not None:
            run.queue_params(flatten({s: section_dict(getattr(params, s)) for s in spec.sections}))
        if not spec.lazy_run:
            run.open()  # now, so that the run's duration is the stage's
        record = body()
        record = record if isinstance(record, dict) else record.to_json()
        seconds = round(time.monotonic() - start, 3)
        if run.opened:
            run.log_metrics({"stage_seconds": seconds})
        # A stage that logged nothing keeps the run id it reports (register points at an existing model's run).
        details = {**record, "seconds": seconds,
                   "mlflow_run_id": run.run_id if run.opened else record.get("mlflow_run_id")}
        if active:
            if (summary := stages.summary(name, details)) is not None:
                write_metrics(stages.metrics_file(metrics_dir, name), summary)
            write_metrics(stages.details_file(metrics_dir, name), details)
            if run.opened:
                run.log_artifact(stages.details_file(metrics_dir, name))
                for suffix in (".csv", ".png") if params is not None else ():  # the plots the stage wrote
                    if (plot := Path(root) / params.paths.plots / f"{name}{suffix}").is_file():
                        run.log_artifact(plot, "plots")
    return details


def _cuda_available(name: str) -> bool:
    """Whether torch sees CUDA (asked only for the train stage, which imports torch anyway)."""
    if name != "train":
        return False
    import torch

    return torch.cuda.is_available()


def stage_main(name: str, body: Callable[[Params, argparse.Namespace], dict[str, object] | StageDetails],
               argv: list[str] | None, parser: argparse.ArgumentParser | None = None) -> int:
    """``python -m pipeline.<name>``: :func:`run_cli` around :func:`run_stage` of ``body(params, args)``."""
    def run(params: Params, args: argparse.Namespace) -> None:
        root = Path(getattr(args, "root", "."))
        run_stage(name, lambda: body(params, args), params=params, metrics_dir=root / params.paths.metrics, root=root)

    return run_cli(name, run, argv, parser or stage_parser(stages.get(name).summary))
