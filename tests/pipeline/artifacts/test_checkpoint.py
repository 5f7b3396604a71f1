"""Checkpoint folders: atomic, DONE-gated, pruned, loaded safely."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from pipeline.artifacts import checkpoint
from pipeline.core.errors import CheckpointError, OutputError

CONFIG = {"model": {"d_model": 16, "n_layers": 1, "vocab_size": 60}, "train": {"lr_scale": 1.0, "max_steps": 10},
          "seed": 1}


def _save(run: Path, step: int, keep_last: int = 5, **extra) -> Path:
    state = {"step": step, "config": CONFIG, "shards_sha256": "abc", **extra}
    return checkpoint.save(run, step, model_state={"w": torch.full((2,), float(step))},
                           optim_state={"state": {}, "param_groups": []}, state=state, keep_last=keep_last)


def test_save_writes_the_four_files_and_no_temporary(tmp_path):
    folder = _save(tmp_path, 12)
    assert folder == tmp_path / "step-00000012"
    assert sorted(p.name for p in folder.iterdir()) == ["DONE", "model.pt", "optim.pt", "state.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".nmt-output", folder.name]  # the training folder's marker
    assert checkpoint.load_tensors(folder, checkpoint.MODEL).keys() == {"w"}
    assert checkpoint.read_state(folder)["step"] == 12


def test_a_failed_save_leaves_nothing_behind(tmp_path):
    _save(tmp_path, 1)
    with pytest.raises(Exception):
        checkpoint.save(tmp_path, 2, model_state={"w": torch.zeros(1)}, optim_state={"bad": threading.Lock()},
                        state={"step": 2}, keep_last=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".nmt-output", "step-00000001"]


def test_a_dead_saves_staging_is_cleaned_a_look_alike_and_a_folder_without_done_are_not(tmp_path):
    _save(tmp_path, 2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    staging = tmp_path / f".step-00000006.{dead.stdout.strip()}.abcd1234.tmp"
    (staging / "step-00000006").mkdir(parents=True)
    (staging / ".nmt-temporary").write_text(json.dumps({"owner": f"{os.uname().nodename}/{dead.stdout.strip()}/",
                                                        "for": "step-00000006"}))
    look_alike = tmp_path / ".step-00000008.notes.tmp"
    look_alike.mkdir()
    assert checkpoint.clean_incomplete(tmp_path) == [staging]
    partial = tmp_path / "step-00000004"
    partial.mkdir()
    (partial / "model.pt").write_bytes(b"garbage")
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000002"
    with pytest.raises(CheckpointError, match="no DONE marker"):
        checkpoint.load_tensors(partial, checkpoint.MODEL)
    with pytest.raises(OutputError, match=r"step-00000004: a step folder without DONE, which this project never "
                                          r"leaves .*; move it out of .*, then rerun the train stage"):
        checkpoint.clean_incomplete(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".nmt-output", ".step-00000008.notes.tmp",
                                                          "step-00000002", "step-00000004"]
    assert (partial / "model.pt").read_bytes() == b"garbage"


def test_keep_last_prunes_the_oldest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=3)
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path)] == [3, 4, 5]


def test_saving_an_existing_step_keeps_it(tmp_path):
    first = _save(tmp_path, 3)
    stamp = (first / "model.pt").stat().st_mtime_ns
    _save(tmp_path, 3)
    assert (first / "model.pt").stat().st_mtime_ns == stamp


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path):
    for step in (900, 10000, 50):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / "DONE").touch()
    (tmp_path / "step-00000007").mkdir()  # no DONE
    (tmp_path / "other").mkdir()
    assert [p.name for _, p in checkpoint.complete_checkpoints(tmp_path)] == ["step-00000050", "step-00000900",
                                                                            "step-00010000"]


def _record_again(folder: Path) -> None:
    """Record the files' current sizes and hashes in state.json, as a foreign writer would."""
    import hashlib

    state = json.loads((folder / checkpoint.STATE).read_text())
    names = (checkpoint.MODEL, checkpoint.OPTIM)
    state["files"] = {name: {"bytes": len(data := (folder / name).read_bytes()),
                             "sha256": hashlib.sha256(data).hexdigest()} for name in names}
    (folder / checkpoint.STATE).write_text(json.dumps(state))


def test_pickled_objects_are_refused(tmp_path):
    folder = _save(tmp_path, 1)
    torch.save({"w": torch.zeros(1), "obj": Path("x")}, folder / "model.pt")  # not weights-only
    _record_again(folder)  # as if written so by a foreign writer (else the sha256 check names it)
    expected = (r"model.pt: not a checkpoint written by this pipeline \(it holds Python objects, not only "
                r"tensors: GLOBAL pathlib.PosixPath\); .*move .* away")
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.load_tensors(folder, checkpoint.MODEL)


def _save_big(run: Path, step: int, keep_last: int = 5) -> Path:
    state = {"step": step, "config": CONFIG, "shards_sha256": "abc"}
    return checkpoint.save(run, step, model_state={"w": torch.arange(4096, dtype=torch.float32) + step},
                           optim_state={"state": {0: {"exp_avg": torch.ones(4096)}}, "param_groups": []},
                           state=state, keep_last=keep_last)


def test_state_json_records_size_and_sha256_of_every_file(tmp_path):
    import hashlib

    folder = _save_big(tmp_path, 3)
    files = checkpoint.read_state(folder)["files"]
    for name in (checkpoint.MODEL, checkpoint.OPTIM):
        data = (folder / name).read_bytes()
        assert files[name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("name", [checkpoint.MODEL, checkpoint.OPTIM])
def test_flipped_bytes_of_the_same_size_are_refused_naming_file_and_remedy(tmp_path, name):
    from tests.helpers.corruption import flip_in_largest_record

    _save_big(tmp_path, 1)
    folder = _save_big(tmp_path, 2)
    flip_in_largest_record(folder / name)
    expected = (rf"step-00000002/{name}: content does not match the sha256 recorded at save .*delete the folder "
                rf".*step-00000002 .*resume from step-00000001")
    with pytest.raises(CheckpointError, match=expected) as info:
        checkpoint.load_tensors(folder, name)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("edit", ["bare size", "renamed sha256", "no files", "renamed bytes"])
def test_a_state_json_without_a_recorded_size_or_sha256_is_refused_naming_the_key(tmp_path, edit):
    _save_big(tmp_path, 1)
    folder = _save_big(tmp_path, 2)
    state = json.loads((folder / checkpoint.STATE).read_text())
    files = state["files"]
    if edit == "bare size":  # the layout of checkpoints from before hashes were recorded
        state["files"] = {name: files[name]["bytes"] for name in files}
    elif edit == "renamed sha256":  # one byte of state.json changed
        files[checkpoint.MODEL]["sha257"] = files[checkpoint.MODEL].pop("sha256")
    elif edit == "renamed bytes":
        files[checkpoint.MODEL]["bytez"] = files[checkpoint.MODEL].pop("bytes")
    else:
        del state["files"]
    (folder / checkpoint.STATE).write_text(json.dumps(state))
    from tests.helpers.corruption import flip_in_largest_record

    flip_in_largest_record(folder / checkpoint.MODEL)  # what a check that was skipped would let through
    key = "bytes" if edit == "renamed bytes" else "sha256"
    expected = (rf"^{folder / checkpoint.STATE}: no files\.model\.pt\.{key} recorded, so model\.pt cannot be "
                rf"checked \(written by an older version, or edited\); delete the folder .*step-00000002 .*resume "
                rf"from step-00000001$")
    with pytest.raises(CheckpointError, match=expected) as info:
        checkpoint.load_tensors(folder, checkpoint.MODEL)
    assert "\n" not in str(info.value)


def test_the_remedy_for_a_corrupt_older_checkpoint_names_the_newest_as_the_resume_point(tmp_path):
    from tests.helpers.corruption import flip_in_largest_record

    folders = [_save_big(tmp_path, step) for step in (1, 2, 3)]
    flip_in_largest_record(folders[0] / checkpoint.MODEL)
    with pytest.raises(CheckpointError, match=r"step-00000001 \(or move it away\) and rerun to resume from "
                                              r"step-00000003$"):
        checkpoint.verify(folders[0], checkpoint.MODEL)


DISK_FULL = ("[enforce fail at inline_container.cc:672] . unexpected pos 8768 vs 8674\n"
             "frame #0: c10::ThrowEnforceNotMet(char const*, int, char const*, std::string const&, void const*)")


@pytest.mark.parametrize("failure", ["inline_container", "enospc", "efbig"])
def test_disk_full_during_save_is_one_line_and_leaves_no_checkpoint(tmp_path, monkeypatch, failure):
    import errno

    from pipeline.core.errors import PipelineError

    _save(tmp_path, 1)
    real_save = torch.save

    def fake_save(obj, f, *args, **kwargs):
        if str(f).endswith(checkpoint.OPTIM):
            if failure == "inline_container":
                raise RuntimeError(DISK_FULL)
            code = errno.ENOSPC if failure == "enospc" else errno.EFBIG
            raise OSError(code, os.strerror(code))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", fake_save)
    with pytest.raises(PipelineError) as info:
        _save(tmp_path, 2)
    message = str(info.value)
    assert "\n" not in message and "inline_container" not in message, message
    assert message.startswith(str(tmp_path / "step-00000002" / checkpoint.OPTIM)), message
    assert (f"could not write the checkpoint: disk full (or file size limit, ulimit -f); free space under "
            f"{tmp_path} or lower train.keep_last, then rerun: training resumes from step-00000001") in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [".nmt-output", "step-00000001"]
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000001"


FSIZE_SCRIPT = r"""
import resource, signal, sys
import torch
from pipeline.core.errors import PipelineError
from pipeline.artifacts import checkpoint
run = sys.argv[1]
state = {"step": 1, "config": {}, "shards_sha256": "abc"}
checkpoint.save(run, 1, model_state={"w": torch.zeros(10)}, optim_state={}, state=state, keep_last=5)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))
try:
    checkpoint.save(run, 2, model_state={"w": torch.zeros(1 << 20)}, optim_state={}, state=state, keep_last=5)
except PipelineError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(1)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE semantics checked on Linux")
def test_a_real_file_size_limit_during_save_is_one_line(tmp_path):
    from tests.helpers.paths import REPO

    proc = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path / "runs")], check=False,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "step-00000002/model.pt: could not write the checkpoint: disk full" in lines[0], lines[0]
    assert "training resumes from step-00000001" in lines[0]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [".nmt-output", "step-00000001"]


def test_a_file_that_is_not_a_checkpoint_is_named_without_torch_advice(tmp_path):
    import pickle

    folder = _save(tmp_path, 1)
    with open(folder / "model.pt", "wb") as fh:
        pickle.dump({"w": Path("x")}, fh)
    _record_again(folder)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_tensors(folder, checkpoint.MODEL)
    message = str(info.value)
    assert "weights_only=False" not in message and "add_safe_globals" not in message, message
    assert "\n" not in message
    assert f"{folder / 'model.pt'}: not a checkpoint written by this pipeline" in message
