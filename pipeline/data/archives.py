"""Reading downloaded archives completely: a truncated or corrupt file is an error naming it (never a silently
short corpus), and tar members that would escape their folder are refused."""

from __future__ import annotations

import gzip
import posixpath
import re
import shutil
import tarfile
import zlib
from collections.abc import Iterable
from pathlib import Path

from pipeline.core.errors import DownloadError

_CHUNK = 1 << 20


class CorruptArchive(DownloadError):
    """A gzip/tar file is truncated or not what its name says."""


def _corrupt(path: Path, exc: BaseException, remedy: str) -> CorruptArchive:
    return CorruptArchive(f"{path}: corrupt or truncated archive ({type(exc).__name__}: {exc}); {remedy}")


def _escapes(name: str) -> bool:
    """Whether the relative path ``name`` points outside the folder it is extracted into."""
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return True
    return posixpath.normpath(name).split("/", 1)[0] == ".."


def _check_member(info: tarfile.TarInfo, archive: Path) -> str:
    """Refuse members that would escape the target folder; return the normalised name."""
    if _escapes(info.name):
        raise DownloadError(f"{archive}: member {info.name!r} points outside the archive's folder; refusing "
                            "to use this archive (delete it and check where it came from)")
    if info.issym() or info.islnk():
        base = posixpath.dirname(info.name) if info.issym() else ""
        if info.linkname.startswith("/") or _escapes(posixpath.join(base, info.linkname)):
            raise DownloadError(f"{archive}: link {info.name!r} -> {info.linkname!r} points outside the archive's "
                                "folder; refusing to use this archive (delete it and check where it came from)")
    if info.isdev():
        raise DownloadError(f"{archive}: member {info.name!r} is a device file; refusing to use this archive")
    return posixpath.normpath(info.name)


def extract_members(archive: Path, members: Iterable[str], dest: Path, *, remedy: str) -> dict[str, Path]:
    """Read the whole tar(.gz) ``archive``, checking every member; copy ``members`` to ``dest``; member -> file."""
    wanted = {posixpath.normpath(m) for m in members}
    found: dict[str, Path] = {}
    try:
        with tarfile.open(archive, mode="r|*") as tar:
            for info in tar:
                name = _check_member(info, archive)
                if name not in wanted:
                    continue
                if not info.isfile():
                    raise DownloadError(f"{archive}: member {name!r} is not a regular file")
                target = dest.joinpath(*name.split("/"))
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(info)
                assert src is not None  # a regular file always has data
                with src, open(target, "wb") as fh:
                    shutil.copyfileobj(src, fh, _CHUNK)
                found[name] = target
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise _corrupt(archive, exc, remedy) from None
    if missing := sorted(wanted - set(found)):
        raise DownloadError(f"{archive}: no member(s) {missing}; the archive is not the expected one or is "
                            f"incomplete: {remedy}")
    return found


def gunzip(src: Path, dest: Path, *, remedy: str) -> Path:
    """Decompress the gzip file ``src`` into ``dest`` completely (truncation is an error)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with gzip.open(src, "rb") as fin, open(dest, "wb") as fout:
            shutil.copyfileobj(fin, fout, _CHUNK)
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise _corrupt(src, exc, remedy) from None
    return dest
