"""Checkpoint folders ``<run>/step-NNNNNNNN/``: atomic, self-describing, prunable.

A folder holds ``model.pt`` (the unwrapped module's state_dict), ``optim.pt``, ``state.json``
and ``DONE``, written last. It is assembled under a hidden temporary name and renamed into
place, so a crash leaves either a complete folder or nothing; a ``step-*`` folder without
``DONE`` (from an older or foreign writer) does not exist for the loader and is deleted by
:func:`clean_incomplete`. ``state.json`` records the byte size of ``model.pt`` and ``optim.pt``,
so a file truncated after the fact (a full disk, a copy cut short) is named before unpickling.
Everything is loaded with ``torch.load(weights_only=True)``. Fault-injection points
(:mod:`pipeline.training.faults`): ``before_save``, ``mid_save``, ``after_save``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from pipeline.core import torchfile
from pipeline.core.errors import CheckpointError
from pipeline.core.textio import atomic_path
from pipeline.training.hooks import Hooks

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{8})$")
_PREFIXES = ("module.", "_orig_mod.")
MODEL, OPTIM, STATE, DONE = "model.pt", "optim.pt", "state.json", "DONE"
# train keys that never change the trajectory: resuming with other values is allowed.
RESUMABLE_TRAIN_KEYS = frozenset({"max_steps", "max_epochs", "max_minutes", "save_every_steps", "keep_last",
                                  "valid_every_steps", "log_every_steps"})


def step_dir(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/step-NNNNNNNN``."""
    return Path(run_dir) / f"step-{step:08d}"


def _step_folders(run_dir: Path) -> list[tuple[int, Path]]:
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found)


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every folder with ``DONE``, oldest first."""
    return [(s, p) for s, p in _step_folders(Path(run_dir)) if (p / DONE).is_file()]


def latest(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1][1] if done else None


def clean_incomplete(run_dir: str | Path) -> list[Path]:
    """Delete ``step-*`` folders without ``DONE`` and leftover temporary folders; return what was removed."""
    run_dir = Path(run_dir)
    removed = [p for _, p in _step_folders(run_dir) if not (p / DONE).is_file()]
    if run_dir.is_dir():
        removed += [p for p in run_dir.iterdir() if p.name.startswith(".step-") and p.name.endswith(".tmp")]
    for path in removed:
        log.warning("removing incomplete checkpoint %s (no %s marker: a run died while writing it)", path, DONE)
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return removed


def unwrap_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes from every key."""
    out = {}
    for key, value in state.items():
        changed = True
        while changed:
            changed = False
            for prefix in _PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix):], True
        out[key] = value
    return out


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def save(run_dir: str | Path, step: int, *, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any],
         state: dict[str, Any], keep_last: int, hooks: Hooks | None = None) -> Path:
    """Write checkpoint ``step`` atomically, then prune to the newest ``keep_last`` complete ones.

    Call on rank 0 only. An existing complete folder for ``step`` is left as it is. ``hooks`` are
    reached at ``before_save``, ``mid_save`` and ``after_save`` (fault-injection tests).

    Returns:
        The checkpoint folder.
    """
    final = step_dir(run_dir, step)
    if (final / DONE).is_file():
        return final
    hooks = hooks or Hooks()
    hooks.at("before_save", step)
    with atomic_path(final) as tmp:
        tmp.mkdir()
        torch.save(unwrap_state_dict(model_state), tmp / MODEL)
        hooks.at("mid_save", step)
        torch.save(optim_state, tmp / OPTIM)
        files = {name: (tmp / name).stat().st_size for name in (MODEL, OPTIM)}
        (tmp / STATE).write_text(json.dumps({**state, "files": files}, indent=1, sort_keys=True) + "\n",
                                 encoding="utf-8")
        for name in (MODEL, OPTIM, STATE):
            _fsync(tmp / name)
        (tmp / DONE).write_text(f"{step}\n", encoding="utf-8")
        _fsync(tmp / DONE)
    _fsync_dir(final.parent)
    hooks.at("after_save", step)
    prune(run_dir, keep_last)
    return final


def _fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prune(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints; return the deleted folders."""
    done = complete_checkpoints(run_dir)
    old = [p for _, p in done[:max(0, len(done) - keep_last)]]
    for path in old:
        # Remove DONE first: a crash in the middle leaves a folder the loader ignores.
        (path / DONE).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return old


def read_state(folder: str | Path) -> dict[str, Any]:
    """``state.json`` of a complete checkpoint folder."""
    folder = Path(folder)
    if not (folder / DONE).is_file():
        raise CheckpointError(f"{folder}: no {DONE} marker; the checkpoint is incomplete and cannot be loaded")
    try:
        return json.loads((folder / STATE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{folder / STATE}: unreadable ({exc}); {_remedy(folder)}") from None


def _remedy(folder: Path) -> str:
    """What to do about a corrupt complete checkpoint: delete it, naming the one the run then resumes from."""
    older = [p for s, p in complete_checkpoints(folder.parent) if p.name < folder.name]
    then = f"from {older[-1].name}" if older else "from scratch (it is the only checkpoint)"
    return f"delete the folder {folder} (or move it away) and rerun to resume {then}"


def load_tensors(folder: str | Path, name: str, device: torch.device | str = "cpu") -> dict[str, Any]:
    """``model.pt`` or ``optim.pt`` of a complete folder, loaded with ``weights_only=True``."""
    folder = Path(folder)
    if not (folder / DONE).is_file():
        raise CheckpointError(f"{folder}: no {DONE} marker; the checkpoint is incomplete and cannot be loaded")
    try:
        return torchfile.load(folder / name, map_location=device, what="cannot be loaded with weights_only=True",
                              remedy=_remedy(folder))
    except CheckpointError:
        _check_size(folder, name)  # a file shorter than recorded is named as truncated
        raise


def _check_size(folder: Path, name: str) -> None:
    """Name a file shorter than ``state.json`` recorded (truncated after the checkpoint completed)."""
    try:
        recorded = json.loads((folder / STATE).read_text(encoding="utf-8")).get("files", {}).get(name)
    except (OSError, json.JSONDecodeError, AttributeError):
        return  # read_state names an unreadable state.json; older checkpoints have no sizes
    if recorded is None:
        return
    try:
        actual = (folder / name).stat().st_size
    except OSError:
        raise CheckpointError(f"{folder / name}: missing although {DONE} exists; {_remedy(folder)}") from None
    if actual < recorded:
        raise CheckpointError(f"{folder / name}: truncated ({actual} of the {recorded} bytes written; a full "
                              f"disk or an interrupted copy?); {_remedy(folder)}")


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: data}


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two resolved configs, as ``key: saved -> current`` lines.

    ``train`` keys in :data:`RESUMABLE_TRAIN_KEYS` (stopping, saving, logging cadence) are ignored.
    """
    a, b = _flat(saved), _flat(current)
    ignored = {f"train.{k}" for k in RESUMABLE_TRAIN_KEYS}
    keys = sorted((set(a) | set(b)) - ignored)
    return [f"{k}: checkpoint {a.get(k, '<absent>')!r}, now {b.get(k, '<absent>')!r}"
            for k in keys if a.get(k, "<absent>") != b.get(k, "<absent>")]


def check_resumable(folder: Path, state: dict[str, Any], *, config: dict[str, Any], shards_sha256: str) -> None:
    """Refuse to resume from ``folder`` under another configuration or other shards.

    Raises:
        CheckpointError: naming every differing key and the remedy.
    """
    diffs = config_differences(state.get("config", {}), config)
    if state.get("shards_sha256") != shards_sha256:
        diffs.append(f"shards manifest sha256: checkpoint {state.get('shards_sha256')!r}, now {shards_sha256!r}")
    if diffs:
        listing = "\n".join(f"  - {d}" for d in diffs)
        raise CheckpointError(
            f"{folder}: cannot resume, the run was started with another configuration or data:\n{listing}\n"
            f"Restore those params (git checkout params.yaml / the shards) to continue this run, or move "
            f"{folder.parent} away to start a new one.")
