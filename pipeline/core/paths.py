"""Where outputs may go (``paths.*`` and output options): every stage replaces its output folder whole."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from pipeline.core.problems import shown
from pipeline.core.yamlfile import load_yaml

CHECKOUT = Path(__file__).resolve().parents[2]
#: The ``paths.*`` keys whose folder several profiles on one dataset may share (the data stages' outputs).
SHARED_DATA = ("raw", "clean", "bpe", "shards")
BASE_PROFILE = "paper"
#: The git-ignored output folders: a stage that replaces its output can never delete tracked files.
OUTPUT_ROOTS = ("data", "runs", "metrics", "plots", "reports")
PATH_RULE = (f"a relative path without '..' inside one of {', '.join(r + '/' for r in OUTPUT_ROOTS)}; "
             "an absolute path only for a params file kept outside the checkout, inside that file's folder")


def path_problem(value: str) -> str | None:
    """Why ``value`` may not be a ``paths.*`` setting (:data:`PATH_RULE`), or None if it may."""
    parts = PurePosixPath(value).parts
    if value.startswith(("/", "\\")) or PurePosixPath(value).is_absolute():
        if ".." not in parts and not Path(value).resolve().is_relative_to(CHECKOUT):
            return None
        reason = "is absolute and inside the checkout or has '..'"
    elif ".." in parts:
        reason = "has a '..' component"
    elif len(parts) < 2 or parts[0] not in OUTPUT_ROOTS:
        reason = "is not inside an output folder"
    else:
        return None
    return f"{shown(value)} {reason} (expected {PATH_RULE})"


def _resolve(value: str, root: Path) -> Path:
    path = Path(value)
    return Path(os.path.normpath(path if path.is_absolute() else root / path))


def _related(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are the same folder or one lies inside the other."""
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def layout_problems(paths: Mapping[str, str], root: str | Path, profile: str | None = None) -> list[str]:
    """Problems with the ``paths`` of a params file in ``root`` (``profile``: its name), one line each."""
    root = Path(os.path.abspath(root))
    mine, problems = {}, []
    for key, value in paths.items():
        where = _resolve(value, root)
        if Path(value).is_absolute() and (where == root or not where.is_relative_to(root)):
            problems.append(f"paths.{key}: {value} lies outside {root}, the folder of the params file; use a "
                            "relative path inside data/, runs/, metrics/, plots/ or reports/")
        elif where.is_relative_to(root / ".git"):
            problems.append(f"paths.{key}: {value} lies inside .git; choose a folder under data/ or runs/")
        else:
            mine[key] = where
    keys = sorted(mine)
    for i, a in enumerate(keys):
        problems += [f"paths.{a} ({paths[a]}) and paths.{b} ({paths[b]}) overlap: each stage replaces its folder "
                     "whole, so give every key a folder of its own" for b in keys[i + 1:] if _related(mine[a], mine[b])]
    others = other_profiles(root, profile)
    for key in keys:
        clash = next(((name, their_key, value) for name, theirs in others.items() for their_key, value in theirs.items()
                      if _clash(key, mine[key], their_key, _resolve(value, root))), None)
        if clash:
            name, their_key, value = clash
            problems.append(f"paths.{key} ({paths[key]}) overlaps profile {name}'s paths.{their_key} ({value}, "
                            f"profiles/{name}.yaml): choose a folder no other profile uses")
    return problems


def _clash(key: str, where: Path, their_key: str, theirs: Path) -> bool:
    """Whether ``paths.key`` at ``where`` collides with another profile's ``paths.their_key`` at ``theirs``."""
    shared_data = key == their_key and key in SHARED_DATA and where == theirs
    return not shared_data and _related(where, theirs)


def other_profiles(root: Path, profile: str | None) -> dict[str, dict[str, str]]:
    """``paths`` of every profile in ``<root>/profiles`` but ``profile`` (the base file's merged under each)."""
    folder = root / "profiles"
    if not (folder / f"{BASE_PROFILE}.yaml").is_file():
        return {}
    base = _paths_of(load_yaml(folder / f"{BASE_PROFILE}.yaml"))
    return {path.stem: base | (_paths_of(load_yaml(path)) if path.stem != BASE_PROFILE else {})
            for path in sorted(folder.glob("*.yaml")) if path.stem != profile}


def _paths_of(data: Any) -> dict[str, str]:  # noqa: ANN401 - a parsed YAML file
    paths = data.get("paths") if isinstance(data, dict) else None
    return {str(k): v for k, v in paths.items() if isinstance(v, str)} if isinstance(paths, dict) else {}


def output_problem(output: str | Path, *, inputs: Iterable[str | Path] = ()) -> str | None:
    """Why a command may not replace ``output`` (the checkout, the current folder, ``.git``, or holding ``inputs``)."""
    target, root = Path(os.path.abspath(output)), CHECKOUT
    if target == Path(os.path.abspath(os.curdir)):
        return f"{output} is the current folder"
    if target == root or root.is_relative_to(target):
        return f"{output} is the checkout {root} or a folder around it"
    if target.is_relative_to(root / ".git"):
        return f"{output} lies inside .git"
    real = Path(os.path.realpath(output))
    for item in inputs:  # also through symbolic links: the folder replaced is the one they lead to
        source, real_source = Path(os.path.abspath(item)), Path(os.path.realpath(item))
        if source == target or source.is_relative_to(target) or real_source.is_relative_to(real):
            return f"{output} is or holds the input {item}"
    return None
