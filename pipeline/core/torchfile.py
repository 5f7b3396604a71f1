"""Reading ``torch.save`` files safely: ``weights_only=True``, and one clear error for a damaged file.

Every torch file the pipeline reads (checkpoint tensors, ``averaged.pt``) goes through :func:`load`,
so a truncated, corrupt or unsafe file is always a :class:`~pipeline.core.errors.CheckpointError`
naming the path, the cause in one line and the remedy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from pipeline.core.errors import CheckpointError


def one_line(exc: BaseException) -> str:
    """The informative line of a (often multi-line, colour-coded) ``torch.load`` error."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if ln.strip()]
    best = next((ln for ln in lines if "Unsupported global" in ln), lines[0] if lines else "")
    return f"{type(exc).__name__}: {best[:300]}"


def load(path: str | Path, *, remedy: str, map_location: torch.device | str = "cpu", mmap: bool = False,
         what: str = "cannot be read", missing: str | None = None) -> Any:
    """``torch.load(path, weights_only=True)``; any failure becomes one :class:`CheckpointError`.

    Args:
        path: the file.
        remedy: the likely cause and what the user should do (ends the message).
        map_location: where tensors are loaded.
        mmap: memory-map the file instead of reading it.
        what: how the failure is described (``cannot be read`` or ``cannot be loaded with weights_only=True``).
        missing: the message for a missing file (default: ``not found``).

    Raises:
        CheckpointError: ``<path>: <what> (<Error>: <first line>); <remedy>``.
    """
    path = Path(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {missing or 'not found'}; {remedy}") from None
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/UnpicklingError/EOFError/KeyError...
        raise CheckpointError(f"{path}: {what} ({one_line(exc)}); {remedy}") from None
