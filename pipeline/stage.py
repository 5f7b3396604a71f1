"""What every stage CLI shares: logging, params loading, metrics files, one-line errors.

A stage module defines ``stage(cfg, *, inputs..., outputs...)`` and a ``main(argv)`` that calls
:func:`run_cli`; ``python -m pipeline.<stage>`` then loads params.yaml, runs it, and turns a
:class:`~pipeline.errors.PipelineError` into one clear line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import Params, load_params
from pipeline.errors import PipelineError
from pipeline.textio import write_text

log = logging.getLogger(__name__)


def setup_logging(level: str | None = None) -> None:
    """Log to stderr with timestamps; level from ``NMT_LOG_LEVEL`` (default INFO)."""
    level = level or os.environ.get("NMT_LOG_LEVEL", "INFO")
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def stage_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every stage accepts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    return parser


def run_cli(name: str, body: Callable[[Params, argparse.Namespace], None], argv: list[str] | None,
            parser: argparse.ArgumentParser | None = None) -> int:
    """Parse args, load params, run ``body``; map known errors to one line and exit code 1."""
    setup_logging()
    parser = parser or stage_parser(f"pipeline stage {name}")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        params = load_params(args.params)
        body(params, args)
    except PipelineError as exc:
        print(f"error: stage {name}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"error: stage {name}: interrupted", file=sys.stderr)
        return 130
    log.info("stage %s finished in %.1f s", name, time.monotonic() - start)
    return 0


def write_metrics(path: str | Path, metrics: dict[str, Any]) -> None:
    """Write a stage's metrics JSON atomically (sorted keys, trailing newline)."""
    write_text(path, json.dumps(metrics, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_json(path: str | Path) -> Any:
    """Read a JSON file, naming it in the error if it is missing or malformed."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(f"{path}: not found; run the upstream stage first (dvc repro)") from None
    except json.JSONDecodeError as exc:
        raise PipelineError(f"{path}: not valid JSON ({exc}); delete it and rerun the stage that writes it") from None
