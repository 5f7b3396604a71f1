"""UTF-8 text split on ``\\n`` only (``str.splitlines`` also splits on ``\\r``, U+0085, U+2028/2029 and would
misalign parallel files); files are written by :mod:`pipeline.core.owned`."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

from pipeline.core.errors import DataError


def read_lines(path: str | Path) -> Iterator[str]:
    """Yield the lines of a UTF-8 file, split on ``\\n`` only, without the newline (a last line without one too).

    Raises:
        DataError: invalid UTF-8 or a NUL byte (names the file and 1-based line number).
    """
    path = Path(path)
    lineno = 0
    with open(path, "rb") as fh:
        for raw in fh:  # binary iteration splits on b"\n" only
            lineno += 1
            yield _decode_line(path, lineno, raw[:-1] if raw.endswith(b"\n") else raw)


def _decode_line(path: str | Path, lineno: int, raw: bytes) -> str:
    """One line's text, or the DataError naming ``path:lineno`` (invalid UTF-8, a NUL byte)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}:{lineno}: invalid UTF-8 at byte {exc.start} of the line; "
                        "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if (byte := raw.find(b"\0")) >= 0:  # valid UTF-8, but the mark of a binary or UTF-16 file
        raise DataError(f"{path}:{lineno}: NUL byte at byte {byte} of the line; this is not UTF-8 "
                        "text (a binary, UTF-16 or corrupt file?): replace the file with the real UTF-8 text "
                        "(e.g. iconv -f utf-16 -t utf-8)")
    return line


def read_line_block(path: str | Path, start: int, end: int, first_line: int) -> list[str]:
    """The lines in bytes ``[start, end)`` of ``path`` (``end`` -1: to the end), numbered from ``first_line``."""
    with open(path, "rb") as fh:
        fh.seek(start)
        raw = fh.read(end - start if end >= 0 else -1)
    if not raw:
        return []
    raw = raw[:-1] if raw.endswith(b"\n") else raw
    with contextlib.suppress(UnicodeDecodeError):
        if "\0" not in (text := raw.decode("utf-8")):
            return text.split("\n")
    return [_decode_line(path, first_line + i + 1, line) for i, line in enumerate(raw.split(b"\n"))]


def line_offsets(path: str | Path, every: int) -> tuple[list[int], int]:
    """Byte offsets of lines 0, every, 2·every, ... of ``path`` and its line count (numpy finds the newlines)."""
    import numpy as np

    offsets, n, pos, last = [0], 0, 0, b"\n"
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            # Line n + j + 1 starts right after the j-th newline of this chunk.
            first = -(-(n + 1) // every) * every  # smallest multiple of every that is > n
            for start in range(first, n + len(newlines) + 1, every):
                offsets.append(pos + int(newlines[start - n - 1]) + 1)
            n += len(newlines)
            pos += len(chunk)
            last = chunk[-1:]
    n += last != b"\n"  # a final line without newline
    if len(offsets) > 1 and offsets[-1] == pos:  # no line starts at end of file
        offsets.pop()
    return offsets, n


def count_lines(path: str | Path) -> int:
    """Number of lines as :func:`read_lines` would yield them (a last line without ``\\n`` counts)."""
    return line_offsets(path, 1 << 62)[1]


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()
