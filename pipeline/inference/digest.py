"""A folder's digest: size and sha256 of every file, written beside them and checked strictly (no key optional)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.errors import PipelineError
from pipeline.core.textio import sha256_file

NAME = "nmt_sha256.json"
FORMAT = 1
#: Names neither recorded nor checked: the digest itself and a folder writer's marker file.
IGNORED = frozenset({NAME, ".nmt-output"})


class DigestError(PipelineError):
    """A folder's files do not match its digest, or the digest is missing or malformed."""


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name not in IGNORED)


def write(folder: str | Path) -> Path:
    """Record the size and sha256 of every file in ``folder`` in ``folder/nmt_sha256.json``.

    Raises:
        DigestError: ``folder`` holds something other than plain files (a digest covers one flat folder).
    """
    folder = Path(folder)
    entries: dict[str, dict[str, int | str]] = {}
    for path in _files(folder):
        if not path.is_file() or path.is_symlink():
            raise DigestError(f"{path}: not a plain file; a digested folder holds files only")
        entries[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    (folder / NAME).write_text(json.dumps({"format": FORMAT, "files": entries}, indent=1, sort_keys=True) + "\n",
                               encoding="utf-8")
    return folder / NAME


def _recorded(folder: Path, remedy: str) -> dict[str, tuple[int, str]]:
    """``{file name: (bytes, sha256)}`` from the digest; every malformed part is an error."""
    path = folder / NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DigestError(f"{folder}: no {NAME} (the sha256 of every file, written at export), so its files cannot "
                          f"be checked; {remedy}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DigestError(f"{path}: unreadable ({type(exc).__name__}); {remedy}") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        raise DigestError(f"{path}: no 'files' record; {remedy}")
    out = {}
    for name, entry in files.items():
        if Path(name).name != name or name in (".", "..") or name in IGNORED:
            raise DigestError(f"{path}: files.{name}: not a file name of this folder; {remedy}")
        for key, kind in (("sha256", str), ("bytes", int)):
            value = entry.get(key) if isinstance(entry, dict) else None
            if not isinstance(value, kind) or isinstance(value, bool):
                raise DigestError(f"{path}: no files.{name}.{key} recorded, so {name} cannot be checked; {remedy}")
        out[name] = (entry["bytes"], entry["sha256"])
    return out


def check(folder: str | Path, *, remedy: str) -> None:
    """Check every file of ``folder`` against ``folder/nmt_sha256.json`` (sizes first, then hashes).

    Raises:
        DigestError: one line naming the file (or the digest and its key), what is wrong and ``remedy``.
    """
    folder = Path(folder)
    recorded = _recorded(folder, remedy)
    present = {p.name: p for p in _files(folder)}
    unlisted = sorted(set(present) - set(recorded))
    if unlisted:
        raise DigestError(f"{folder / unlisted[0]}: not listed in {NAME} (added after the export?); {remedy}")
    for name, (size, _) in sorted(recorded.items()):
        path = present.get(name)
        if path is None or not path.is_file():
            raise DigestError(f"{folder / name}: missing (listed in {NAME}); {remedy}")
        actual = path.stat().st_size
        if actual != size:
            what = (f"truncated ({actual} of the {size} bytes recorded in {NAME})" if actual < size
                    else f"{actual} bytes, but {NAME} records {size}")
            raise DigestError(f"{path}: {what}; {remedy}")
    for name, (_, sha) in sorted(recorded.items()):
        if sha256_file(folder / name) != sha:
            raise DigestError(f"{folder / name}: content does not match the sha256 in {NAME} (bit rot, a bad copy "
                              f"or an edit?); {remedy}")
