"""benchmarks/train.py times the real model and loss against ``nn.Transformer``: on a tiny configuration,
every output it promises (the table's JSON and the ``--profile`` operator table) is written."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.paths import load_benchmark


def test_the_training_benchmark_writes_its_json_and_the_profilers_table(tmp_path: Path) -> None:
    bench = load_benchmark("train")
    bench.CONFIGS["test"] = {"d_model": 32, "n_heads": 2, "d_ff": 64, "n_layers": 1, "vocab_size": 300,
                             "batch": 6, "max_len": 10}
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--config", "test", "--threads", "1", "--repeats", "2", "--iters", "1",
                           "--out", str(tmp_path / "train.json"), "--profile", str(tmp_path / "profile.txt")]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "train.json").read_text(encoding="utf-8"))
    assert result["config"] == "test" and result["compiled"] == "none"
    assert {k: len(v) for k, v in result["seconds_per_step"].items()} == {"ours": 2, "nn.Transformer": 2}
    assert result["target_tokens"] > 0 and all(v > 0 for v in result["tgt_tokens_per_s"].values())
    table = (tmp_path / "profile.txt").read_text(encoding="utf-8")
    assert table.startswith("3 steps of our model, sorted by self_cpu_time_total")
    assert "aten::mm" in table or "aten::addmm" in table
