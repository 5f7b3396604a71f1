"""Reading ``torch.save`` files safely: ``weights_only=True``, and one clear error for a damaged file."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch

from pipeline.core.errors import CheckpointError


def one_line(exc: BaseException) -> str:
    """The informative line of a (often multi-line, colour-coded) ``torch.load`` error."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if ln.strip()]
    best = next((ln for ln in lines if "Unsupported global" in ln), lines[0] if lines else "")
    return f"{type(exc).__name__}: {best[:300]}"


def refused_object(exc: BaseException) -> str | None:
    """What the ``weights_only`` unpickler refused (``GLOBAL pathlib.PosixPath``), or None for another failure."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    if "Weights only load failed" not in text and "WeightsUnpickler error" not in text:
        return None
    found = re.search(r"Unsupported global: (GLOBAL \S+)", text) or re.search(r"Unsupported (operand \S+)", text)
    return found.group(1) if found else "an object weights_only=True refuses"


def load(path: str | Path, *, remedy: str, mmap: bool = False, what: str = "cannot be read",
         missing: str | None = None) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU; any failure is one :class:`CheckpointError`
    ``<path>: <what> (<Error>: <first line>); <remedy>``, or "not a checkpoint written by this pipeline"."""
    path = Path(path)
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4": the error below says it better
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {missing or 'not found'}; {remedy}") from None
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/UnpicklingError/EOFError/KeyError...
        refused = refused_object(exc)
        if refused is not None:
            raise CheckpointError(f"{path}: not a checkpoint written by this pipeline (it holds Python objects, "
                                  f"not only tensors: {refused}); {remedy}") from None
        raise CheckpointError(f"{path}: {what} ({one_line(exc)}); {remedy}") from None
