"""Command-line plumbing shared by ``nmt`` and the flows: one-line usage errors, bounded option types, plain help."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

#: reST roles (:func:`x`, :mod:`~a.b`) and inline literals (``x``), as docstrings here write them.
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``prog: error: ...; see prog --help``), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]  # argparse types it NoReturn
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def at_least(least: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"{text:.40}: must be an integer >= {least}")
        return value

    return parse


def finite_float(text: str) -> float:
    """An argparse ``type``: a finite number."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text:.40}: must be a finite number")
    return value


def plain(doc: str) -> str:
    """A docstring as help text: reST roles and ````literals```` as their bare text."""
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", doc))
