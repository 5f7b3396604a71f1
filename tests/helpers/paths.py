"""Where things are: the repository root and the shared EN-DE data folder."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def shared_data() -> Path:
    """The real EN-DE data folder (read-only), if this machine has one: ``$NMT_SHARED_DATA``, else
    ``shared/data`` beside the checkout (as in CI), else /work/shared/data. Tests that need it skip
    when it is absent, so a fresh clone anywhere still passes."""
    for candidate in (os.environ.get("NMT_SHARED_DATA"), REPO.parent / "shared" / "data", "/work/shared/data"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return REPO / "no-shared-data"


SHARED = shared_data()
