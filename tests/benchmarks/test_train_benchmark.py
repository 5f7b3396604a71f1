"""benchmarks/train.py times the real model and loss against ``nn.Transformer``: on a tiny configuration, the
JSON it promises is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.paths import load_benchmark

TINY = {"d_model": 32, "n_heads": 2, "d_ff": 64, "n_layers": 1, "vocab_size": 300}  # a model for seconds, not speed


def _main(bench, *args: str) -> int:
    """``bench.main(args)``, this process's torch thread count restored afterwards."""
    threads = torch.get_num_threads()
    try:
        return bench.main(list(args))
    finally:
        torch.set_num_threads(threads)


def test_the_training_benchmark_writes_its_json(tmp_path: Path) -> None:
    bench = load_benchmark("train")
    bench.CONFIGS["test"] = {**TINY, "batch": 6, "max_len": 10}
    assert _main(bench, "--config", "test", "--threads", "1", "--repeats", "2", "--iters", "1",
                 "--out", str(tmp_path / "train.json")) == 0
    result = json.loads((tmp_path / "train.json").read_text(encoding="utf-8"))
    assert result["config"] == "test" and result["compiled"] == "none"
    assert {k: len(v) for k, v in result["seconds_per_step"].items()} == {"ours": 2, "nn.Transformer": 2}
    assert result["target_tokens"] > 0 and all(v > 0 for v in result["tgt_tokens_per_s"].values())


def test_news_steps_are_the_train_stages_plan_on_news_lengths() -> None:
    bench = load_benchmark("train")
    spec = {"vocab_size": 300, "tokens_per_step": 2000, "steps": 4}
    steps = bench.make_news_steps(spec, torch.device("cpu"), max_tokens=1000)
    assert len(steps) == 4
    mean_lengths = []
    for passes, n_tok in steps:
        assert 0 < n_tok <= 2000 and sum(int(p[2].ne(bench.PAD).sum()) for p in passes) == n_tok
        for src, tgt_in, tgt_out in passes:  # each pass within the memory budget (sentences x longest)
            assert src.shape[0] * max(src.shape[1], tgt_in.shape[1]) <= 1000 or src.shape[0] == 1
            assert tgt_in[:, 0].eq(bench.BOS).all() and (src.eq(bench.EOS).sum(1) == 1).all()
        mean_lengths.append(sum(int(p[2].ne(bench.PAD).sum()) for p in passes) / sum(p[0].shape[0] for p in passes))
    assert mean_lengths == sorted(mean_lengths)  # evenly spaced through the length-sorted plan


def test_the_news_config_times_whole_cycles_of_its_steps(tmp_path: Path) -> None:
    bench = load_benchmark("train")
    bench.CONFIGS["news-test"] = {**TINY, "tokens_per_step": 800, "steps": 2}
    with pytest.raises(SystemExit, match="--iters 3: config news-test has 2 steps; use a multiple of it"):
        _main(bench, "--config", "news-test", "--threads", "1", "--iters", "3", "--out", str(tmp_path / "x"))
    assert _main(bench, "--config", "news-test", "--threads", "1", "--repeats", "1", "--iters", "2",
                 "--max-tokens", "400", "--out", str(tmp_path / "train.json")) == 0
    result = json.loads((tmp_path / "train.json").read_text(encoding="utf-8"))
    assert 0 < result["target_tokens"] <= 800 and result["tgt_tokens_per_s"]["ours"] > 0
    assert not (tmp_path / "x").exists()


def test_the_lean_loss_is_timed(tmp_path: Path) -> None:
    bench = load_benchmark("train")
    bench.CONFIGS["test"] = {**TINY, "batch": 6, "max_len": 10}
    assert _main(bench, "--config", "test", "--threads", "1", "--repeats", "1", "--iters", "1", "--loss", "lean",
                 "--out", str(tmp_path / "train.json")) == 0
    result = json.loads((tmp_path / "train.json").read_text(encoding="utf-8"))
    assert result["loss"] == "lean" and result["causal_flash"] is False and result["tgt_tokens_per_s"]["ours"] > 0
