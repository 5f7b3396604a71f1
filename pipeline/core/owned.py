"""What a command may replace or delete: the one rule, and the only module that replaces, renames or deletes.

1. An output is built in a staging folder beside its path and renamed into place; a failed build is deleted and
   the previous version is kept. A file output replaces only a regular file.
2. A folder output replaces a folder only when the folder's ``.nmt-output`` marker names the same role and lists
   every file (with its size) and folder in it: a folder holding anything else is the user's, and is refused.
   A folder that grows in place (the training folder) is claimed: made with a marker naming its role, or adopted
   while empty; one holding anything without that marker is refused. Only folders its marker vouches for are
   retired inside it (a checkpoint beyond ``train.keep_last``).
3. A temporary is a staging folder ``.<name>.<pid>.<random>.tmp/`` holding a ``.nmt-temporary`` marker that names
   its process (host, pid, start time); only such a folder whose process has ended is cleaned up, never a file or
   folder that merely looks like one.
4. A symbolic link, block device or socket is never replaced; a FIFO or character device (a terminal,
   ``/dev/null``) or a link into the process's open files (``/dev/stdout``) is written into when a command's
   output option names it, and refused as a stage's output.
5. Bookkeeping files the project names itself (a download's ``.part``, a paused run's marker, the params a profile
   switch put aside) are deleted by :func:`discard` and renamed by :func:`move_file`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from pipeline.core.errors import OutputError
from pipeline.core.owner import owner, owner_gone
from pipeline.core.write_errors import STAGING_NAME, public_path, staged_write_error, write_error

log = logging.getLogger(__name__)

#: The marker of a folder output: its role, and every entry it holds (a size, or "dir").
MARKER = ".nmt-output"
#: The marker inside a staging folder: the process that made it and the name it is for.
TEMP_MARKER = ".nmt-temporary"
_FD_FOLDER = re.compile(r"^/proc/(self|\d+)/fd$")
_SPECIAL = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
            stat.S_IFSOCK: "a socket"}


def _entry(st: os.stat_result) -> int | str:
    """How a manifest records an entry: a regular file's size, ``dir``, or what else it is."""
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    return "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "other"


def _listing(folder: Path) -> dict[str, int | str]:
    """Every entry below ``folder`` (its marker aside), relative path -> :func:`_entry` (links not followed)."""
    found: dict[str, int | str] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            full = os.path.join(root, name)
            found[os.path.relpath(full, folder)] = _entry(os.lstat(full))
    found.pop(MARKER, None)
    return found


def _record(folder: Path) -> dict | None:
    """The parsed marker of ``folder`` (None: none, unreadable, or not this version's JSON)."""
    try:
        record = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("role"), str) else None


def _not_ours(folder: Path, role: str | None) -> str | None:
    """Why ``folder`` may not be replaced as a ``role`` output (None: it may)."""
    record = _record(folder)
    if record is None:
        return (f"its {MARKER} is an older version's, which lists no files: if only this project wrote the folder, "
                "delete it yourself") if (folder / MARKER).exists() else f"it holds no {MARKER} marker"
    if role is None or record["role"] != role:
        return f"its {MARKER} says {record['role']!r}"
    listed = record.get("entries")
    if not isinstance(listed, dict):
        return f"its {MARKER} lists no files"
    extra = sorted(rel for rel, kind in _listing(folder).items() if listed.get(rel) != kind)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        return f"it holds {extra[0]}{more}, which its {MARKER} does not list as written by this project"
    return None


def _kind(path: Path) -> str | None:
    """What is at ``path`` (links not followed): None, ``file``, ``folder``, ``link`` or a :data:`_SPECIAL` name."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return "link"
    return "folder" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else _SPECIAL.get(stat.S_IFMT(mode),
                                                                                                "a special file")


def writes_into(path: str | Path) -> bool:
    """Whether an output option naming ``path`` means writing into it: a FIFO or character device (also through a
    link), or a link into this process's open files (``/dev/stdout``, ``/dev/fd/N``)."""
    hop = os.path.abspath(path)
    for _ in range(16):  # a chain of links, as the kernel follows them (ELOOP past 40)
        if _FD_FOLDER.match(os.path.realpath(os.path.dirname(hop))):
            return True
        if not os.path.islink(hop):
            break
        hop = os.path.join(os.path.dirname(hop), os.readlink(hop))
    with contextlib.suppress(OSError):
        return stat.S_IFMT(os.stat(path).st_mode) in (stat.S_IFIFO, stat.S_IFCHR)
    return False


def refuse_foreign(path: Path, role: str | None, *, replacing_with_folder: bool = False) -> None:
    """Raise :class:`OutputError` unless ``path`` is nothing, a folder this module may replace as a ``role`` output
    (rule 2), or a regular file no folder is to replace."""
    shown, kind = public_path(path), _kind(path)
    if kind == "link":
        raise OutputError(f"{shown}: is a symbolic link, not an output this project wrote; refusing to replace "
                          "it: remove the link or choose another output path")
    if kind not in (None, "file", "folder"):
        raise OutputError(f"{shown}: is {kind}, not an output this project wrote; refusing to replace it: "
                          "choose another output path")
    if kind == "folder" and (why := _not_ours(path, role)):
        what = f"a {role} folder" if role else "an output folder"
        raise OutputError(f"{shown}: refusing to replace this folder: it is not {what} this project wrote "
                          f"({why}); move it away or choose another output path")
    if kind == "file" and replacing_with_folder:
        raise OutputError(f"{shown}: is a file; refusing to replace it with a folder: move it away or choose "
                          "another output path")


def refuse_unvouched(path: Path) -> None:
    """Raise :class:`OutputError` unless ``path`` may be deleted as a declared output before its stage runs (what
    DVC does): nothing, a regular file, or a folder whose marker, of any role, lists everything in it (rule 2)."""
    refuse_foreign(path, (_record(path) or {}).get("role") if _kind(path) == "folder" else None)


def _new_staging(path: Path, option: str | None = None) -> Path:
    """A marked staging folder for ``path`` beside it (rule 3); a dead run's for the same name is removed first."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if public_path(path.parent) == path.parent:  # a folder we are building holds no stale siblings
            remove_stale(path.parent, path.name)
        made = tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
        staging = path.parent / Path(made).name  # as relative as ``path``, so errors name paths as configured
        try:
            (staging / TEMP_MARKER).write_text(json.dumps({"owner": owner(), "for": path.name}) + "\n",
                                               encoding="utf-8")
        except OSError:
            os.rmdir(staging)
            raise
    except OSError as exc:  # the folder or the staging folder could not be made
        failed = public_path(os.fsdecode(exc.filename)) if exc.filename is not None else path
        raise write_error(exc, path if failed == path.absolute() else failed, path, option=option) or exc from None
    return staging


def remove_stale(parent: str | Path, name: str | None = None) -> list[Path]:
    """Delete and return the staging folders in ``parent`` (for ``name``, or any) whose process has ended."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    for entry in entries:
        match = STAGING_NAME.match(entry.name)
        if not match or name not in (None, match.group(1)) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            record = json.loads(Path(entry.path, TEMP_MARKER).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue  # no marker: not ours
        if isinstance(record, dict) and record.get("for") == match.group(1) and owner_gone(str(record.get("owner"))):
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.lexists(entry.path):
                log.info("removed %s, left behind by an interrupted run", Path(entry.path))
                removed.append(Path(entry.path))
    return removed


def _swap_in(payload: Path, path: Path, staging: Path) -> None:
    """Rename ``payload`` onto ``path``; a folder there (checked replaceable) goes into ``staging`` first."""
    if payload.is_dir() and path.is_dir():
        old = staging / f"{path.name}.replaced"  # deleted with the staging folder
        os.rename(path, old)
        try:
            os.rename(payload, path)
        except OSError:
            os.rename(old, path)
            raise
        return
    if payload.is_file():
        with open(payload, "rb") as fh:
            os.fsync(fh.fileno())
    os.replace(payload, path)


@contextlib.contextmanager
def atomic_path(path: str | Path, role: str | None = None, *, option: str | None = None,
                into_streams: bool = False) -> Iterator[Path]:
    """Yield a path to fill (a file, or a folder the caller makes) inside a staging folder; on success rename it onto
    ``path`` (a folder gets a :data:`MARKER` naming ``role`` and listing what it holds), on error delete it.

    Args:
        path: the output.
        role: a folder output's role (rule 2).
        option: the command-line option that named ``path`` (``--output``), for the remedy of a failed write.
        into_streams: a FIFO, character device or ``/dev/stdout`` at ``path`` is yielded as it is, to write into.

    Raises:
        OutputError: ``path`` is not ours to replace, or a write failed for lack of space, quota or permission.
    """
    path = Path(path)
    if into_streams and writes_into(path):
        try:
            yield path
        except OSError as exc:
            raise write_error(exc, path, option=option) or exc from None
        return
    refuse_foreign(path, role)
    staging = _new_staging(path, option)
    payload = staging / path.name
    try:
        yield payload
        if payload.is_dir() and role is not None:
            entries = _listing(payload)
            (payload / MARKER).write_text(json.dumps({"role": role, "entries": entries}, indent=0, sort_keys=True)
                                          + "\n", encoding="utf-8")
        refuse_foreign(path, role, replacing_with_folder=payload.is_dir())
        _swap_in(payload, path, staging)
    except BaseException as exc:
        failure = staged_write_error(exc, payload, path, option) if isinstance(exc, OSError) else None
        if failure is not None:
            raise failure from None  # the staging folder goes in the finally below
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def scratch_folder(parent: str | Path, name: str) -> Iterator[Path]:
    """A marked temporary folder ``<staging>/<name>`` in ``parent`` for the block, deleted after it (a killed run's
    is deleted by the next, rule 3)."""
    staging = _new_staging(Path(parent) / name)
    try:
        (staging / name).mkdir()
        yield staging / name
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def claim_folder(path: str | Path, role: str, *, make: bool = True) -> Path:
    """Make ``path`` a folder this project writes in place as ``role`` (rule 2): made with a marker, or adopted while
    empty; one holding anything without a marker naming ``role`` is refused (:class:`OutputError`). ``make``
    False: only refuse, write nothing."""
    path = Path(path)
    if path.is_dir() and (_record(path) or {}).get("role") == role:
        return path
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path}: is a file, not a {role} folder; move it away or choose another folder")
    if path.is_dir() and any(path.iterdir()):
        raise OutputError(f"{path}: refusing to write in this folder: it holds files but no {MARKER} marker naming "
                          f"{role!r}, so this project did not make it; move them away or choose another folder")
    if not make:
        return path
    with atomic_path(path / MARKER) as tmp:
        tmp.write_text(json.dumps({"role": role}) + "\n", encoding="utf-8")
    return path


def retire(folder: str | Path, role: str) -> None:
    """Delete ``folder``, which this project wrote inside a claimed ``role`` folder (a checkpoint past keep_last):
    renamed into a staging folder first, so a crash leaves it whole or gone, never half."""
    folder = Path(folder)
    if (_record(folder.parent) or {}).get("role") != role:
        raise OutputError(f"{folder}: not deleted: {folder.parent} holds no {MARKER} marker naming {role!r}")
    staging = _new_staging(folder)
    try:
        os.rename(folder, staging / folder.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def discard(path: str | Path) -> None:
    """Delete a bookkeeping file the project names itself (rule 5); nothing if it is gone."""
    Path(path).unlink(missing_ok=True)


def move_file(source: str | Path, target: str | Path) -> None:
    """Rename a bookkeeping file (rule 5: a finished download's ``.part``) onto ``target``."""
    os.replace(source, target)


def write_lines(path: str | Path, lines: Iterable[str], *, option: str | None = None) -> int:
    """Write ``lines`` as UTF-8, each followed by ``\\n``, atomically (into a stream, with ``option``); the count."""
    n = 0
    with atomic_path(path, option=option, into_streams=option is not None) as tmp, \
            open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        for n, line in enumerate(lines, 1):
            fh.write(line + "\n")
    return n


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` as UTF-8 atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
