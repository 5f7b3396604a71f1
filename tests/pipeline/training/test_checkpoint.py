"""Checkpoint folders: atomic, DONE-gated, pruned, loaded safely, refused under another config."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from pipeline.core.errors import CheckpointError
from pipeline.training import checkpoint

CONFIG = {"model": {"d_model": 16, "n_layers": 1, "vocab_size": 60}, "train": {"lr_scale": 1.0, "max_steps": 10},
          "seed": 1}


def _save(run: Path, step: int, keep_last: int = 5, **extra) -> Path:
    state = {"step": step, "config": CONFIG, "shards_sha256": "abc", **extra}
    return checkpoint.save(run, step, model_state={"module.w": torch.full((2,), float(step))},
                           optim_state={"state": {}, "param_groups": []}, state=state, keep_last=keep_last)


def test_save_writes_the_four_files_and_no_temporary(tmp_path):
    folder = _save(tmp_path, 12)
    assert folder == tmp_path / "step-00000012"
    assert sorted(p.name for p in folder.iterdir()) == ["DONE", "model.pt", "optim.pt", "state.json"]
    assert list(tmp_path.iterdir()) == [folder]
    assert checkpoint.load_tensors(folder, checkpoint.MODEL).keys() == {"w"}  # module. prefix stripped
    assert checkpoint.read_state(folder)["step"] == 12


def test_a_failed_save_leaves_nothing_behind(tmp_path):
    _save(tmp_path, 1)
    with pytest.raises(Exception):
        checkpoint.save(tmp_path, 2, model_state={"w": torch.zeros(1)}, optim_state={"bad": threading.Lock()},
                        state={"step": 2}, keep_last=5)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]


def test_folder_without_done_is_ignored_then_cleaned(tmp_path):
    _save(tmp_path, 2)
    partial = tmp_path / "step-00000004"
    partial.mkdir()
    (partial / "model.pt").write_bytes(b"garbage")
    leftover = tmp_path / ".step-00000006.abc.tmp"
    leftover.mkdir()
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000002"
    with pytest.raises(CheckpointError, match="no DONE marker"):
        checkpoint.load_tensors(partial, checkpoint.MODEL)
    removed = checkpoint.clean_incomplete(tmp_path)
    assert sorted(p.name for p in removed) == [".step-00000006.abc.tmp", "step-00000004"]
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]


def test_keep_last_prunes_the_oldest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=3)
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path)] == [3, 4, 5]


def test_saving_an_existing_step_keeps_it(tmp_path):
    first = _save(tmp_path, 3)
    stamp = (first / "model.pt").stat().st_mtime_ns
    _save(tmp_path, 3)
    assert (first / "model.pt").stat().st_mtime_ns == stamp


def test_unwrap_strips_ddp_and_compile_prefixes():
    sd = {"module._orig_mod.a.weight": 1, "_orig_mod.b": 2, "c": 3}
    assert checkpoint.unwrap_state_dict(sd) == {"a.weight": 1, "b": 2, "c": 3}


def test_pickled_objects_are_refused(tmp_path):
    folder = _save(tmp_path, 1)
    torch.save({"w": torch.zeros(1), "obj": Path("x")}, folder / "model.pt")  # not weights-only
    expected = (r"model.pt: cannot be loaded with weights_only=True \(UnpicklingError: .*Unsupported global: "
                r".*move .* away")
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.load_tensors(folder, checkpoint.MODEL)


def test_config_mismatch_names_every_differing_key_and_the_remedy(tmp_path):
    folder = _save(tmp_path, 1)
    state = checkpoint.read_state(folder)
    other = json.loads(json.dumps(CONFIG))
    other["model"]["d_model"] = 32
    other["train"]["lr_scale"] = 2.0
    other["train"]["max_steps"] = 20  # stopping rules may change on resume
    with pytest.raises(CheckpointError) as err:
        checkpoint.check_resumable(folder, state, config=other, shards_sha256="def")
    msg = str(err.value)
    assert "model.d_model: checkpoint 16, now 32" in msg and "train.lr_scale: checkpoint 1.0, now 2.0" in msg
    assert "shards manifest sha256" in msg and "max_steps" not in msg
    assert "Restore those params" in msg and f"move {tmp_path} away" in msg


def test_same_config_with_other_stopping_rules_is_resumable(tmp_path):
    folder = _save(tmp_path, 1)
    other = json.loads(json.dumps(CONFIG))
    other["train"]["max_steps"] = 50
    checkpoint.check_resumable(folder, checkpoint.read_state(folder), config=other, shards_sha256="abc")
