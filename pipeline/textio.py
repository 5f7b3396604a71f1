"""UTF-8 text split on ``\\n`` only, and atomic output paths.

``str.splitlines`` also splits on ``\\r``, U+0085, U+2028/2029 and would misalign parallel
EN/DE files, so every stage reads lines through :func:`read_lines`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from pipeline.errors import DataError

_CHUNK = 1 << 20


def read_lines(path: str | Path) -> Iterator[str]:
    """Yield the lines of a UTF-8 file, split on ``\\n`` only, without the newline.

    A final line without ``\\n`` is still yielded; an empty file yields nothing.

    Raises:
        DataError: invalid UTF-8 (names the file and 1-based line number).
    """
    path = Path(path)
    lineno = 0
    with open(path, "rb") as fh:
        for raw in fh:  # binary iteration splits on b"\n" only
            lineno += 1
            if raw.endswith(b"\n"):
                raw = raw[:-1]
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: invalid UTF-8 at byte {exc.start} of the line; "
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None


def count_lines(path: str | Path) -> int:
    """Number of lines as :func:`read_lines` would yield them (a last line without ``\\n`` counts)."""
    n = 0
    last = b"\n"
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _tmp_sibling(path: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(name)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path; on success rename it onto ``path``, on error delete it.

    Works for files and directories: the caller creates whatever it likes at the yielded path.
    An existing directory at ``path`` is removed just before the rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    tmp.unlink()
    try:
        yield tmp
        if tmp.is_dir():
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        if tmp.is_file():
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_lines(path: str | Path, lines: Iterable[str]) -> int:
    """Write ``lines`` as UTF-8, each followed by ``\\n``, atomically; return the count."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        for line in lines:
            fh.write(line)
            fh.write("\n")
            n += 1
    return n


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` as UTF-8 atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
