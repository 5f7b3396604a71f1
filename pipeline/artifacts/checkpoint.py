"""Checkpoint folders ``<run>/step-NNNNNNNN/``: written atomically, each file's size and sha256 checked before load."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import torch

from pipeline.artifacts import torchfile
from pipeline.core.errors import CheckpointError, OutputError
from pipeline.core.owned import atomic_path, claim_folder, remove_stale, retire
from pipeline.core.textio import sha256_file
from pipeline.core.yamlfile import PlainMapping

_NAME = re.compile(r"^step-(\d{8})$")
#: The role of a training folder's marker (pipeline/core/owned.py, claim_folder).
ROLE = "train"
MODEL, OPTIM, STATE, DONE = "model.pt", "optim.pt", "state.json", "DONE"


def step_dir(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/step-NNNNNNNN``."""
    return Path(run_dir) / f"step-{step:08d}"


def _step_folders(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step-*`` folder, oldest first."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found)


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every folder with ``DONE``, oldest first."""
    return [(s, p) for s, p in _step_folders(Path(run_dir)) if (p / DONE).is_file()]


def incomplete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step-*`` folder without ``DONE``, oldest first."""
    return [(s, p) for s, p in _step_folders(Path(run_dir)) if not (p / DONE).is_file()]


def digests(run_dir: str | Path) -> dict[str, str]:
    """Each complete checkpoint of ``run_dir``: step folder name -> its model.pt's sha256 recorded at save."""
    return {folder.name: _recorded(folder, MODEL, corrupt_remedy(folder))[1]
            for _, folder in complete_checkpoints(run_dir)}


def latest(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1][1] if done else None


def clean_incomplete(run_dir: str | Path) -> list[Path]:
    """Claim ``run_dir`` as a training folder, delete what killed saves left there (their staging folders), and
    refuse a ``step-*`` folder without ``DONE``: a save renames only complete folders into place, so this project
    did not leave it. Returns what was removed.

    Raises:
        OutputError: ``run_dir`` holds files this project did not write (pipeline/core/owned.py), or such a folder.
    """
    run_dir = claim_folder(run_dir, ROLE)
    removed = remove_stale(run_dir)
    if found := incomplete_checkpoints(run_dir):
        raise OutputError(f"{found[0][1]}: a step folder without {DONE}, which this project never leaves (it writes "
                          f"a checkpoint whole); move it out of {run_dir}, then rerun the train stage")
    return removed


def _fsync(path: Path) -> None:
    """Flush ``path`` to disk (a folder: the renames inside it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StateFile(TypedDict, total=False):
    """A checkpoint's ``state.json`` (pipeline/training/state.py ``TrainState.to_json``), as read: the position
    (TrainState's fields), and what the run may resume under."""

    step: int
    epoch: int
    position: int
    tokens_seen: int
    tokens_sq: float
    tokens_min: int
    tokens_max: int
    src_tokens_seen: int | None
    forwards: int
    forwards_max: int
    train_seconds: float
    oom_skipped: int
    interval: dict[str, float]
    history: list[dict[str, float]]
    world_size: int
    config: PlainMapping  # model + train + seed sections
    shards_sha256: str
    mlflow_run_id: str | None


def save(run_dir: str | Path, step: int, *, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any],
         state: StateFile, keep_last: int, at: Callable[[str, int], None] = lambda point, step: None) -> Path:
    """Write checkpoint ``step`` atomically (rank 0), prune to ``keep_last``, return its folder; ``at``: fault hook."""
    final = step_dir(claim_folder(run_dir, ROLE), step)
    if (final / DONE).is_file():
        return final
    at("before_save", step)
    with atomic_path(final) as tmp:
        tmp.mkdir()
        writing = MODEL
        try:
            torch.save(model_state, tmp / MODEL)
            at("mid_save", step)
            writing = OPTIM
            torch.save(optim_state, tmp / OPTIM)
            files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
                     for name in (MODEL, OPTIM)}
            writing = STATE
            (tmp / STATE).write_text(json.dumps({**state, "files": files}, indent=1, sort_keys=True) + "\n",
                                     encoding="utf-8")
            for writing in (MODEL, OPTIM, STATE):
                _fsync(tmp / writing)
            writing = DONE
            (tmp / DONE).write_text(f"{step}\n", encoding="utf-8")
            _fsync(tmp / DONE)
        except (RuntimeError, OSError) as exc:
            if not _disk_full(exc):
                raise
            # Raised inside atomic_path: the temporary folder is deleted, no step folder appears.
            raise OutputError(_disk_full_message(final / writing)) from None
    with contextlib.suppress(OSError):  # where directories cannot be opened
        _fsync(final.parent)
    at("after_save", step)
    prune(run_dir, keep_last)
    return final


_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
# What torch.save's C++ zip writer says when a write comes up short (ENOSPC, EFBIG under ulimit -f).
_DISK_FULL_MARKERS = ("inline_container", "unexpected pos", "iostream error")


def _disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised while handling) is a short write to a full disk."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return True
        if isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DISK_FULL_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _disk_full_message(path: Path) -> str:
    """One line for a checkpoint file that could not be written, naming the checkpoint a rerun resumes from."""
    done = complete_checkpoints(path.parent.parent)
    then = f"training resumes from {done[-1][1].name}" if done else "training starts again from scratch"
    return (f"{path}: could not write the checkpoint: disk full (or file size limit, ulimit -f); free space "
            f"under {path.parent.parent} or lower train.keep_last, then rerun: {then}")


def prune(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints; return the deleted folders."""
    done = complete_checkpoints(run_dir)
    old = [p for _, p in done[:max(0, len(done) - keep_last)]]
    for path in old:
        retire(path, ROLE)
    return old


def _require_done(folder: Path) -> None:
    """Refuse a folder without ``DONE``."""
    if not (folder / DONE).is_file():
        raise CheckpointError(f"{folder}: no {DONE} marker; the checkpoint is incomplete and cannot be loaded")


def read_state(folder: str | Path) -> StateFile:
    """``state.json`` of a complete checkpoint folder."""
    folder = Path(folder)
    _require_done(folder)
    try:
        return json.loads((folder / STATE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{folder / STATE}: unreadable ({exc}); {corrupt_remedy(folder)}") from None


def corrupt_remedy(folder: Path, average_window: int | None = None) -> str:
    """What to do about a corrupt complete checkpoint (``average_window``: ``average.last_n``, for averaging)."""
    done = complete_checkpoints(folder.parent)
    others = [p.name for _, p in done if p != folder]
    delete = f"delete the folder {folder} (or move it away)"
    if average_window is None:
        return f"{delete} and rerun to resume " + (f"from {others[-1]}" if others else
                                                    "from scratch (it is the only checkpoint)")
    if not others:
        return f"{delete} and retrain (`dvc repro train`): it is the only complete checkpoint"
    # The checkpoints are no DVC output (dvc.yaml): --force reruns train, which resumes, before average.
    rerun = f"{delete} and rerun `dvc repro --force --single-item train && dvc repro average`: train resumes"
    last = f"average then averages the last {average_window} complete checkpoints"
    if done[-1][1] == folder:  # the newest: training resumes before it and writes that step again
        return f"{rerun} from {others[-1]} and trains {folder.name} again; {last}"
    return (f"{rerun} from {others[-1]} and does not write {folder.name} again; {last} "
            f"({', '.join(others[-average_window:])}, unless train goes on past {others[-1]})")


def load_tensors(folder: str | Path, name: str, *, remedy: str | None = None) -> dict[str, Any]:
    """``model.pt`` or ``optim.pt`` of a complete folder on CPU, :func:`verify`-ed; ``remedy`` ends any error."""
    folder = Path(folder)
    _require_done(folder)
    remedy = remedy or corrupt_remedy(folder)
    verify(folder, name, remedy=remedy)
    return torchfile.load(folder / name, what="cannot be loaded with weights_only=True", remedy=remedy)


def load_state_dict(folder: str | Path, *, remedy: str | None = None) -> dict[str, torch.Tensor]:
    """``model.pt`` of a complete folder on CPU (:func:`load_tensors`), checked to be a state_dict of tensors."""
    state = load_tensors(folder, MODEL, remedy=remedy)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{Path(folder) / MODEL}: not a state_dict of tensors; was it written by the train "
                              "stage?")
    return state


def _recorded(folder: Path, name: str, remedy: str) -> tuple[int, str]:
    """The byte size and sha256 of ``folder/name`` that ``state.json`` recorded at save (``files.<name>``)."""
    try:
        state = json.loads((folder / STATE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{folder / STATE}: unreadable ({type(exc).__name__}); {remedy}") from None
    recorded = {}
    with contextlib.suppress(AttributeError):  # not a dict at some level
        recorded = state.get("files").get(name)
    for key, kind in (("sha256", str), ("bytes", int)):
        value = recorded.get(key) if isinstance(recorded, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{folder / STATE}: no files.{name}.{key} recorded, so {name} cannot be checked "
                                  f"(written by an older version, or edited); {remedy}")
    return recorded["bytes"], recorded["sha256"]


def verify(folder: str | Path, name: str, *, remedy: str | None = None) -> None:
    """Check ``folder/name`` against ``state.json``'s size and sha256 (CheckpointError, also without a record)."""
    folder = Path(folder)
    remedy = remedy or corrupt_remedy(folder)
    size, digest = _recorded(folder, name, remedy)
    try:
        actual = (folder / name).stat().st_size
    except OSError:
        raise CheckpointError(f"{folder / name}: missing although {DONE} exists; {remedy}") from None
    if actual < size:
        raise CheckpointError(f"{folder / name}: truncated ({actual} of the {size} bytes written; a full "
                              f"disk or an interrupted copy?); {remedy}")
    if actual != size:
        raise CheckpointError(f"{folder / name}: {actual} bytes, but {size} were written at save (overwritten or "
                              f"a bad copy?); {remedy}")
    if sha256_file(folder / name) != digest:
        raise CheckpointError(f"{folder / name}: content does not match the sha256 recorded at save (bit rot, a "
                              f"bad copy or an edit?); {remedy}")
