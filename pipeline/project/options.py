"""Command-line plumbing shared by ``nmt`` and the flows: one-line usage errors, help text from docstrings."""

from __future__ import annotations

import argparse
import re

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
