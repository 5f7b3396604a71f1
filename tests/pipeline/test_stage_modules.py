"""Each stage module runs as DVC runs it (``python -m pipeline.<stage>``) without runpy's
"found in sys.modules" warning: nothing imports the module before ``-m`` executes it, not even the
workers of the encode stage's process pool (they re-run the main module as ``__mp_main__``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.stages import NAMES
from pipeline.project.profiles import merged_profile
from tests.helpers.bpe_encode import run_bpe, synthetic_clean
from tests.helpers.paths import REPO

RUNPY_WARNING = "found in sys.modules"


def _run_module(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "NMT_TRACKING": "off", **(env or {})})


@pytest.mark.parametrize("name", [*NAMES, "launch"])
def test_help_of_every_stage_module_has_no_runpy_warning(name: str) -> None:
    proc = _run_module(f"pipeline.{name}", "--help")
    assert proc.returncode == 0, proc.stderr
    assert RUNPY_WARNING not in proc.stderr, proc.stderr


def test_encode_with_a_process_pool_has_no_runpy_warning(tmp_path: Path) -> None:
    """Two workers, several shards: the pool's workers start, and each one re-runs the main module."""
    clean = synthetic_clean(tmp_path, n_train=200)
    bpe_dir = run_bpe(tmp_path, clean)
    data = merged_profile("tiny", REPO)
    data["paths"].update(clean=str(clean), bpe=str(bpe_dir), shards=str(tmp_path / "shards"),
                         metrics=str(tmp_path / "metrics"))
    data["encode"]["shard_rows"] = 50
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(data), encoding="utf-8")
    proc = _run_module("pipeline.encode", "--params", str(params), env={"NMT_DATA_WORKERS": "2"})
    assert proc.returncode == 0, proc.stderr
    assert len(list((tmp_path / "shards" / "train").glob("part-*.parquet"))) >= 4
    assert RUNPY_WARNING not in proc.stderr, proc.stderr
