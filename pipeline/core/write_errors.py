"""One line for a write that failed for lack of space, quota or permission: what, where, and what to do."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

from pipeline.core.errors import OutputError

# A staging folder of pipeline/core/owned.py: .<name>.<pid>.<8 random chars>.tmp
STAGING_NAME = re.compile(r"^\.(.+)\.\d+\.[A-Za-z0-9_]{8}\.tmp$")
_DISK_FULL = {
    errno.ENOSPC: ("no space left on the device", "free space on the file system holding {folder} (df -h {folder})"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota on {folder} or have it raised"),
    errno.EFBIG: ("file size limit reached", "raise the file size limit (ulimit -f) or the file system's maximum"),
}
_NOT_ALLOWED = {errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                errno.EROFS: "read-only file system"}


def public_path(path: str | Path) -> Path:
    """``path`` as the user named it: a staging folder ``.<name>.<pid>.<random>.tmp`` and the ``<name>`` it holds
    are shown as ``<name>``."""
    parts, shown = Path(path).parts, []
    for i, part in enumerate(parts):
        match = STAGING_NAME.match(part)
        if match is None:
            shown.append(part)
        elif i + 1 == len(parts) or parts[i + 1] != match.group(1):
            shown.append(match.group(1))  # the staging folder itself; else its payload follows and stands for it
    return Path(*shown) if shown else Path(path)


def newest_file(tmp: Path) -> Path:
    """The file under folder ``tmp`` written last (the one a failed buffered write was filling), or ``tmp``."""
    best: tuple[int, int, str] | None = None
    for root, _, files in os.walk(tmp):  # nothing when tmp is not a folder
        for name in files:
            with contextlib.suppress(OSError):  # a file that vanished meanwhile
                st = os.stat(os.path.join(root, name))
                best = max(best or (0, 0, ""), (st.st_mtime_ns, st.st_size, os.path.join(root, name)))
    return Path(best[2]) if best else tmp


def write_error(exc: OSError, target: str | Path, output: str | Path | None = None, *,
                option: str | None = None) -> OutputError | None:
    """A one-line :class:`OutputError` with the remedy for a full disk, quota, size limit or permission, else None.

    Args:
        exc: the failed write's error.
        target: the file or folder that could not be written.
        output: the output it was part of (its previous version is kept, or nothing was written there).
        option: the command-line option that named the output (``--output``); None for a stage's ``paths.*``.
    """
    target = public_path(target)
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    rerun = "run the command again" if option else "rerun the stage"
    if exc.errno in _DISK_FULL:
        reason, remedy = _DISK_FULL[exc.errno]
        remedy = remedy.format(folder=target.parent)
    elif exc.errno in _NOT_ALLOWED:
        reason = _NOT_ALLOWED[exc.errno]
        elsewhere = f"give {option} a path on a writable disk" if option else "point paths.* in params.yaml elsewhere"
        remedy = f"make {target.parent} writable by this user, or {elsewhere}"
    else:
        return None
    message = f"cannot write {target}: {reason} ({code}); {remedy}, then {rerun}"
    if output is not None:
        output = public_path(output)
        kept = "the previous complete version is kept" if output.exists() else "nothing was written there"
        message += f" ({output}: {kept})"
    return OutputError(message)


def staged_write_error(exc: OSError, tmp: Path, path: Path, option: str | None = None) -> OutputError | None:
    """:func:`write_error` for an error raised while building ``tmp`` (the future ``path``), if it is about ``tmp``."""
    if exc.filename is not None:
        failed = Path(os.fsdecode(exc.filename))
        if failed != tmp and tmp not in failed.parents:
            return None  # e.g. an input that cannot be read: not ours to explain
    else:
        failed = newest_file(tmp)
    return write_error(exc, path if failed == tmp else path / failed.relative_to(tmp), path, option=option)
