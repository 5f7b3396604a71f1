"""The command line ``nmt`` and the flows share: one-line usage errors, help text from docstrings, and the options
of a run of the Prefect flow wmt14-pipeline, defined once for ``nmt run`` and for ``python -m flows.pipeline``
(``nmt run`` takes the stages as positionals, the flow as ``--stages``)."""

from __future__ import annotations

import argparse
import math
import re

from pipeline.core.console import arg_type
from pipeline.project.profiles import known_profiles

DESCRIPTION = ("The Prefect flow wmt14-pipeline: each DVC stage as one task (dvc repro --single-item STAGE, in its "
               "own process group) under one MLflow parent run, then a report.")
DEFAULT_KILL_GRACE_S = 30.0
#: reST roles (:func:`x`, :mod:`~a.b`) and inline literals (``x``), as docstrings here write them.
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``prog: error: ...; see prog --help``), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]  # argparse types it NoReturn
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def plain(doc: str) -> str:
    """A docstring as help text: reST roles and ````literals```` as their bare text."""
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", doc))


_seconds = arg_type(float, lambda seconds: math.isfinite(seconds) and seconds >= 0, "seconds, a finite number >= 0")


def stage_seconds(text: str) -> tuple[str, float]:
    """An argparse ``type``: ``STAGE=SECONDS`` as ``(stage, seconds)``."""
    stage, equals, value = text.partition("=")
    if not (stage and equals):
        raise argparse.ArgumentTypeError(f"{text:.60}: expected STAGE=SECONDS, e.g. train=86400")
    return stage, _seconds(value)


def add_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add the flow's options but the stage selection to ``parser``; returns them for :func:`flow_argv`."""
    return [
        parser.add_argument("--profile", help=f"first switch the workspace to this profile, as nmt profile NAME "
                                              f"does ({known_profiles()}); it stays switched"),
        parser.add_argument("--force", action="store_true", help="rerun stages even if DVC finds them up to date"),
        parser.add_argument("--repo", default=".", help="project checkout holding dvc.yaml (default: .)"),
        parser.add_argument("--timeout", action="append", default=[], type=stage_seconds, metavar="STAGE=SECONDS",
                            help="a stage's wall-clock limit; its process group is killed (repeatable; 0: none)"),
        parser.add_argument("--retry-delay", action="append", default=[], type=stage_seconds, metavar="STAGE=SECONDS",
                            help="seconds before retrying a failed stage (repeatable)"),
        parser.add_argument("--no-push", dest="push", action="store_false",
                            help="leave the results here: no dvc push --run-cache to the default DVC remote at the "
                                 "end (default: push)"),
        parser.add_argument("--kill-grace", type=_seconds, default=DEFAULT_KILL_GRACE_S, metavar="SECONDS",
                            help=f"seconds from SIGTERM to SIGKILL when a stage is stopped "
                                 f"(default {DEFAULT_KILL_GRACE_S:g})"),
    ]


def flow_argv(args: argparse.Namespace) -> list[str]:
    """The options :func:`add_options` parsed into ``args``, as the flow's command line (defaults left out)."""
    argv: list[str] = []
    for action in add_options(argparse.ArgumentParser(add_help=False)):
        flag, value = action.option_strings[0], getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(value, bool):
            argv.append(flag)
        else:
            for item in value if isinstance(value, list) else [value]:
                argv += [flag, "=".join(map(str, item)) if isinstance(item, tuple) else str(item)]
    return argv
