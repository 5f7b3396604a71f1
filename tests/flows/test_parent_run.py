"""What the MLflow parent run is called and which headline metrics it carries (plain functions, no servers)."""

from __future__ import annotations

import re
import time

from flows.parent_run import run_name
from flows.report import HEADLINE_METRICS, headline_metrics

EVALUATE = {"valid": {"bleu": 25.5, "chrf2": 51.0, "ppl": 6.25, "signatures": {}},
            "test": {"bleu": 27.25, "chrf2": 55.5}, "chosen": {"beam": 4}}


def test_the_name_says_profile_commit_and_time() -> None:
    when = time.mktime((2026, 11, 25, 18, 40, 0, 0, 0, -1))
    assert run_name("demo", "291a2df0123456789", when) == "demo 291a2df 2026-11-25 18:40"
    assert run_name("tiny", "").startswith("tiny no-git ")
    assert re.fullmatch(r"paper abcdef0 \d{4}-\d\d-\d\d \d\d:\d\d", run_name("paper", "abcdef0123"))


def test_headline_metrics_on_gpu_and_cpu() -> None:
    gpu = headline_metrics(EVALUATE, {"step": 100000, "wall_seconds": 43200.0, "world_size": 8, "device": "cuda"})
    assert gpu == {"test_bleu": 27.25, "valid_bleu": 25.5, "test_chrf": 55.5, "valid_chrf": 51.0, "valid_ppl": 6.25,
                   "train_steps": 100000.0, "gpu_hours": 96.0}
    assert set(gpu) == set(HEADLINE_METRICS)
    cpu = headline_metrics(EVALUATE, {"step": 700, "wall_seconds": 534.8, "world_size": 1, "device": "cpu"})
    assert cpu["gpu_hours"] == 0.0 and cpu["train_steps"] == 700.0


def test_missing_files_and_odd_values_are_left_out() -> None:
    assert headline_metrics({}, {}) == {}
    odd = {"valid": {"bleu": "n/a", "ppl": True}, "test": {"bleu": 20}}
    assert headline_metrics(odd, {"step": None}) == {"test_bleu": 20.0}
