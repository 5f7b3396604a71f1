"""Reading ``nmt translate``'s input lines, bounded: a line of at most :data:`MAX_LINE_BYTES`, an ``--input``
file of at most :data:`MAX_INPUT_BYTES`, read in 64 KiB pieces (``os.read``) so that neither an endless line
(``/dev/zero``) nor a huge one is held whole or joined again on every read."""

from __future__ import annotations

import os
import select
from collections.abc import Iterator

from pipeline.core.errors import PipelineError

#: Lines read from standard input are translated at the latest when this many are waiting.
STREAM_LINES = 4096
#: The longest input line, in bytes (some 150,000 words): the model reads at most ``max_positions`` tokens of
#: a line, and without a bound a line that never ends (``/dev/zero``) is read until memory runs out.
MAX_LINE_BYTES = 1 << 20
#: The largest ``--input`` file, read whole with its translations (newstest2014's English side: 0.4 MB).
MAX_INPUT_BYTES = 1 << 28


def split_lines(data: bytes) -> list[bytes]:
    """``data`` split on ``\\n`` only, without the newlines (a last line without one is kept)."""
    return data.removesuffix(b"\n").split(b"\n") if data else []


def read_bounded(fd: int, name: str, max_total: int | None = None) -> Iterator[list[bytes]]:
    """The complete lines of each ``os.read`` of ``fd`` (a list, maybe empty), the last line without a newline at
    the end; a partial line is kept in pieces and joined once, when its newline comes.

    Raises:
        PipelineError: a line longer than :data:`MAX_LINE_BYTES`, or more than ``max_total`` bytes (names ``name``).
    """
    pieces: list[bytes] = []
    held = done = total = 0  # bytes of the partial line; lines completed; bytes read
    while data := os.read(fd, 1 << 16):
        total += len(data)
        if max_total is not None and total > max_total:
            raise PipelineError(f"{name}: more than {max_total} bytes (MAX_INPUT_BYTES: --input is read whole); "
                                "translate it in parts, or pipe it to standard input, translated as lines arrive")
        *complete, rest = data.split(b"\n")
        if complete:
            complete[0] = b"".join([*pieces, complete[0]])
            pieces, held = [], 0
        for i, line in enumerate(complete):
            if len(line) > MAX_LINE_BYTES:
                _too_long(name, done + i + 1)
        done += len(complete)
        if rest:
            pieces.append(rest)
            held += len(rest)
            if held > MAX_LINE_BYTES:
                _too_long(name, done + 1)
        yield complete
    if pieces:
        yield [b"".join(pieces)]


def _too_long(name: str, number: int) -> None:
    raise PipelineError(f"{name}: line {number} is longer than {MAX_LINE_BYTES} bytes (MAX_LINE_BYTES; the model "
                        "reads at most max_positions tokens of a line anyway); put one sentence on each line")


def read_input(path: str) -> list[bytes]:
    """The lines of the ``--input`` file, as :func:`split_lines` splits them, read in bounded pieces.

    Raises:
        PipelineError: ``path`` cannot be read, holds a line over :data:`MAX_LINE_BYTES` or is over
            :data:`MAX_INPUT_BYTES` (``/dev/zero`` is refused at its first :data:`MAX_LINE_BYTES`).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise PipelineError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        return [line for complete in read_bounded(fd, path, MAX_INPUT_BYTES) for line in complete]
    except OSError as exc:  # a folder (EISDIR), an I/O error
        raise PipelineError(f"{path}: cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)


def stream_chunks(fd: int, max_lines: int = STREAM_LINES) -> Iterator[list[bytes]]:
    """The lines of ``fd`` in chunks (what has arrived when no more is ready, at most ``max_lines``), read with
    ``os.read``: a Python buffered reader could hide lines from ``select``. Each line is bounded
    (:func:`read_bounded`); the whole stream is not, as its translations leave as they are made."""
    pending: list[bytes] = []
    try:
        for complete in read_bounded(fd, "standard input"):
            pending.extend(complete)
            while len(pending) >= max_lines:
                yield pending[:max_lines]
                pending = pending[max_lines:]
            if pending and not select.select([fd], [], [], 0)[0]:  # nothing more ready to read
                yield pending
                pending = []
    except PipelineError:  # a line over the bound: the lines before it are translated first
        if pending:
            yield pending
        raise
    if pending:
        yield pending
