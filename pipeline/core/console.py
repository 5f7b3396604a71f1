"""What a command shows its user: logging to stderr with credentials redacted, argparse helpers, and any error as one
line (:func:`run_cli`, which also loads the params)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from pipeline.core import env
from pipeline.core.config import Params, load_params
from pipeline.core.errors import EXIT_PERMANENT, ConfigError, PermanentError, PipelineError
from pipeline.core.write_errors import public_path, write_error

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
