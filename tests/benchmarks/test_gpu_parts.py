"""benchmarks/gpu_parts.py times CUDA kernels only: without CUDA it refuses before writing anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.paths import load_benchmark


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_parts_benchmark_refuses_without_cuda_and_writes_nothing(tmp_path: Path) -> None:
    bench = load_benchmark("gpu_parts")
    with pytest.raises(SystemExit, match="times CUDA kernels and this machine has no CUDA device"):
        bench.main(["--out", str(tmp_path / "parts.json")])
    assert not (tmp_path / "parts.json").exists()
