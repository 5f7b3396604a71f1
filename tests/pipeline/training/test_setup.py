"""Resuming is refused under another configuration or other shards, allowed under other stopping rules."""

from __future__ import annotations

import copy

import pytest

from pipeline.core.errors import CheckpointError
from pipeline.training.setup import check_resumable

CONFIG = {"model": {"d_model": 16, "n_layers": 1, "vocab_size": 60}, "train": {"lr_scale": 1.0, "max_steps": 10},
          "seed": 1}
STATE = {"step": 1, "config": CONFIG, "shards_sha256": "abc"}


def test_config_mismatch_names_every_differing_key_and_the_remedy(tmp_path):
    other = copy.deepcopy(CONFIG)
    other["model"]["d_model"] = 32
    other["train"]["lr_scale"] = 2.0
    other["train"]["max_steps"] = 20  # stopping rules may change on resume
    with pytest.raises(CheckpointError) as err:
        check_resumable(tmp_path / "step-00000001", STATE, config=other, shards_sha256="def")
    msg = str(err.value)
    assert "model.d_model: checkpoint 16, now 32" in msg and "train.lr_scale: checkpoint 1.0, now 2.0" in msg
    assert "shards manifest sha256" in msg and "max_steps" not in msg
    assert "Restore those params" in msg and f"move {tmp_path} away" in msg


def test_same_config_with_other_stopping_rules_is_resumable(tmp_path):
    other = copy.deepcopy(CONFIG)
    other["train"]["max_steps"] = 50
    check_resumable(tmp_path / "step-00000001", STATE, config=other, shards_sha256="abc")


def test_a_state_saved_before_source_tokens_were_counted_reports_no_source_mean_rather_than_a_partial_one():
    from dataclasses import asdict

    from pipeline.training.state import TrainState

    fresh = TrainState()
    for tgt, src in ((100, 90), (50, 64)):
        fresh.count(tgt, 1, src)
    assert fresh.batch_stats()["src_tokens_per_step_mean"] == 77.0 and fresh.batch_stats()["tokens_per_step_mean"] == 75
    assert TrainState.from_json(asdict(fresh)).src_tokens_seen == 154  # resumed: the count goes on
    old = TrainState.from_json({k: v for k, v in asdict(fresh).items() if k != "src_tokens_seen"})
    old.count(100, 1, 90)
    assert old.src_tokens_seen is None and old.batch_stats()["src_tokens_per_step_mean"] is None
    assert TrainState.from_json({}).src_tokens_seen == 0  # a run from scratch counts from 0
