"""UTF-8 text split on ``\\n`` only (``str.splitlines`` also splits on ``\\r``, U+0085, U+2028/2029 and would
misalign parallel files), and atomic outputs: built beside their place and renamed onto it."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from pipeline.core.errors import DataError, OutputError

log = logging.getLogger(__name__)

#: The file naming the role of every folder :func:`atomic_path` writes: only the same role replaces it.
MARKER = ".nmt-output"
# A temporary sibling made by atomic_path: .<name>.<pid>.<8 random chars>.tmp
_TMP_NAME = re.compile(r"^\.(.+)\.\d+\.[A-Za-z0-9_]{8}\.tmp$")
_DISK_FULL = {
    errno.ENOSPC: ("no space left on the device", "free space on the file system holding {folder} (df -h {folder})"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota on {folder} or have it raised"),
    errno.EFBIG: ("file size limit reached", "raise the file size limit (ulimit -f) or the file system's maximum"),
}
_NOT_ALLOWED = {errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                errno.EROFS: "read-only file system"}


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


def _tmp_sibling(path: Path) -> Path:
    """A fresh ``.<name>.<pid>.<random>.tmp`` beside ``path`` (the pid tells a later run whether it is stale)."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return path.parent / Path(name).name  # as relative as ``path``, so errors name paths as configured


def public_path(path: str | Path) -> Path:
    """``path`` with each temporary component ``.<name>.<pid>.<random>.tmp`` shown as ``<name>``."""
    return Path(*(_TMP_NAME.sub(r"\1", part) for part in Path(path).parts))


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    with contextlib.suppress(OSError, IndexError):  # no /proc (not Linux): os.kill's answer stands
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    return True


def remove_stale_temps(path: str | Path) -> list[Path]:
    """Delete and return the ``.<name>.*.tmp`` siblings of ``path`` left by dead runs (a live pid's are kept)."""
    path = Path(path)
    prefix = f".{path.name}."
    removed = []
    try:
        entries = [e for e in os.scandir(path.parent) if e.name.startswith(prefix) and e.name.endswith(".tmp")]
    except OSError:
        return []
    for entry in entries:
        pid = entry.name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or pid_alive(int(pid))):
            continue
        stale = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        if not os.path.lexists(stale):
            log.info("removed %s, left behind by an interrupted run", stale)
            removed.append(stale)
    return removed


def newest_file(tmp: Path) -> Path:
    """The file under folder ``tmp`` written last (the one a failed buffered write was filling), or ``tmp``."""
    best: tuple[int, int, str] | None = None
    for root, _, files in os.walk(tmp):  # nothing when tmp is not a folder
        for name in files:
            with contextlib.suppress(OSError):  # a file that vanished meanwhile
                st = os.stat(os.path.join(root, name))
                best = max(best or (0, 0, ""), (st.st_mtime_ns, st.st_size, os.path.join(root, name)))
    return Path(best[2]) if best else tmp


def write_error(exc: OSError, target: str | Path, output: str | Path | None = None) -> OutputError | None:
    """A one-line :class:`OutputError` with the remedy for a full disk, quota, size limit or permission, else None."""
    target = public_path(target)
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    if exc.errno in _DISK_FULL:
        reason, remedy = _DISK_FULL[exc.errno]
        remedy = remedy.format(folder=target.parent)
    elif exc.errno in _NOT_ALLOWED:
        reason = _NOT_ALLOWED[exc.errno]
        remedy = f"make {target.parent} writable by this user, or point paths.* in params.yaml elsewhere"
    else:
        return None
    message = f"cannot write {target}: {reason} ({code}); {remedy}, then rerun the stage"
    if output is not None:
        output = public_path(output)
        kept = "the previous complete version is kept" if output.exists() else "nothing was written there"
        message += f" ({output}: {kept})"
    return OutputError(message)


def _as_write_error(exc: OSError, tmp: Path, path: Path) -> OutputError | None:
    """:func:`write_error` for an error raised while building ``tmp`` (the future ``path``), if it is about ``tmp``."""
    if exc.filename is not None:
        failed = Path(os.fsdecode(exc.filename))
        if failed != tmp and tmp not in failed.parents:
            return None  # e.g. an input that cannot be read: not ours to explain
    else:
        failed = newest_file(tmp)
    return write_error(exc, path if failed == tmp else path / failed.relative_to(tmp), path)


def refuse_foreign(path: Path, role: str | None, *, replacing_with_folder: bool = False) -> None:
    """Raise :class:`OutputError` unless ``path`` is nothing, a folder marked ``role``, or a file no folder replaces."""
    shown = public_path(path)
    if path.is_symlink():
        raise OutputError(f"{shown}: is a symbolic link, not an output this project wrote; refusing to replace "
                          "it: remove the link or choose another output path")
    if path.is_dir():
        try:
            found = (path / MARKER).read_text(encoding="utf-8").strip() or None
        except (OSError, UnicodeDecodeError):
            found = None  # no marker: not a folder this project wrote whole
        if role is None or found != role:
            what = f"a {role} folder" if role else "an output folder"
            why = f"its {MARKER} says {found!r}" if found else f"it holds no {MARKER} marker"
            raise OutputError(f"{shown}: refusing to replace this folder: it is not {what} this project wrote "
                              f"({why}); move it away or choose another output path")
    elif replacing_with_folder and path.exists():
        raise OutputError(f"{shown}: is a file; refusing to replace it with a folder: move it away or choose "
                          "another output path")


@contextlib.contextmanager
def atomic_path(path: str | Path, role: str | None = None) -> Iterator[Path]:
    """Yield a temporary sibling path to fill; on success rename it onto ``path`` (a folder gets a :data:`MARKER`
    naming ``role`` and replaces only a folder whose marker names the same), on error delete it.

    Raises:
        OutputError: ``path`` is not ours to replace, or a write failed for lack of space, quota or permission.
    """
    path = Path(path)
    refuse_foreign(path, role)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if public_path(path.parent) == path.parent:  # a folder we are building holds no stale siblings
            remove_stale_temps(path)
        tmp = _tmp_sibling(path)
        tmp.unlink()
    except OSError as exc:  # the folder or the temporary sibling could not be made
        failed = public_path(os.fsdecode(exc.filename)) if exc.filename is not None else path
        raise write_error(exc, path if failed == path.absolute() else failed, path) or exc from None
    try:
        yield tmp
        if tmp.is_dir():
            if role is not None:
                (tmp / MARKER).write_text(role + "\n", encoding="utf-8")
            refuse_foreign(path, role, replacing_with_folder=True)
            if path.is_dir():
                shutil.rmtree(path)
        if tmp.is_file():
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        failure = _as_write_error(exc, tmp, path) if isinstance(exc, OSError) else None
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if failure is not None:
            raise failure from None
        raise


def write_lines(path: str | Path, lines: Iterable[str]) -> int:
    """Write ``lines`` as UTF-8, each followed by ``\\n``, atomically; return the count."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        for n, line in enumerate(lines, 1):
            fh.write(line + "\n")
    return n


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` as UTF-8 atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
