"""Where things are: the repository root, the shared EN-DE data folder and the benchmark scripts."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

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


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
