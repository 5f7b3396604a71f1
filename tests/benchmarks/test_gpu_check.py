"""benchmarks/gpu_check.py, the script a lent GPU machine runs, dry-run on the CPU so it cannot rot.

The dry run does every step on the tiny profile with a few steps each, on data the script's own
``prepare`` made from a synthetic Multi30k mirror; on the CPU, bf16 autocast is off, so the precision
curves agree exactly, and CPU training is deterministic, so the determinism step finds bitwise equality.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.helpers.mirror import write_multi30k_mirror
from tests.helpers.paths import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _script(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_the_device_script_dry_runs_every_step_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "NMT_DATA_MIRROR": str(write_multi30k_mirror(tmp_path / "mirror")),
           "NMT_CLEAN_WORKERS": "1", "NMT_ENCODE_WORKERS": "1", "NMT_THREADS": "1", "OMP_NUM_THREADS": "1"}
    data, out, work = tmp_path / "data", tmp_path / "out", tmp_path / "work"
    done = _script("prepare", "--data", str(data), "--profiles", "tiny", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (data / "tiny" / "shards" / "manifest.json").is_file()
    done = _script("run", "--dry-run", "--data", str(data), "--out", str(out), "--work", str(work), "--profiles",
                   "tiny", "tiny", "--steps", "tiny", "pytest", "precision", "determinism", "attention", "throughput",
                   env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))
    assert result["env"]["torch"] and "error" not in json.dumps(result)
    assert [result["tiny"][s]["rc"] for s in ("train", "average", "evaluate")] == [0, 0, 0]
    assert result["tiny"]["metrics"]["train"]["step"] == 6
    assert result["pytest"]["rc"] == 0 and "skipped" in result["pytest"]["summary"]  # CUDA tests, no CUDA
    assert result["precision"]["compare"]["train_loss"] == {"points": 3, "max_abs": 0.0, "max_rel": 0.0}
    assert result["determinism"]["default"]["a_vs_resumed"] == {
        "model.pt": {"bitwise_equal": True, "max_abs_diff": 0.0},
        "optim.pt": {"bitwise_equal": True, "max_abs_diff": 0.0}, "history_equal": True}
    assert set(result["attention"]) == {"shipped", "cudnn_allowed"}
    assert result["throughput"]["small"]["rc"] == 0 and result["throughput"]["small"]["tgt_tokens_per_s"]["ours"] > 0
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/tiny-evaluate.log" in names and "precision-fp32/plots/train.csv" in names
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "logs.tar.gz"]  # a device call returns <= 8
