"""Stage ``average``: the mean of the last N complete checkpoints; clear errors for bad ones."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from model import Transformer, TransformerConfig
from pipeline.artifacts.averaging import average_state_dicts
from pipeline.artifacts.model_file import NAME as AVERAGED_NAME
from pipeline.average import stage
from pipeline.core.config import AverageConfig
from pipeline.core.details import AverageDetails
from pipeline.core.errors import CheckpointError
from tests.helpers.models import TINY_MODEL, make_spm, spm_vocab_size, tiny_model, write_checkpoint


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bpe")
    make_spm(directory)
    return directory


def _run(tmp_path: Path, spm_dir: Path, last_n: int) -> tuple[dict, AverageDetails]:
    metrics = stage(AverageConfig(last_n=last_n), train_dir=tmp_path / "train", bpe_dir=spm_dir,
                    model_dir=tmp_path / "model")
    return torch.load(tmp_path / "model" / AVERAGED_NAME, map_location="cpu", weights_only=True), metrics


def test_two_checkpoints_average_to_their_mean_and_file_is_self_contained(tmp_path: Path, spm_dir: Path) -> None:
    vocab = spm_vocab_size(spm_dir / "spm.model")
    a, b, c = (tiny_model(vocab, seed).state_dict() for seed in (1, 2, 3))
    write_checkpoint(tmp_path / "train", 5, a)
    write_checkpoint(tmp_path / "train", 10, b)
    write_checkpoint(tmp_path / "train", 15, c)
    write_checkpoint(tmp_path / "train", 20, a, done=False)  # incomplete: does not exist
    out, metrics = _run(tmp_path, spm_dir, last_n=2)
    assert set(out) == {"model", "config", "spm", "sha256"}
    assert set(out["model"]) == set(b)
    for key in b:
        torch.testing.assert_close(out["model"][key], (b[key].float() + c[key].float()) / 2, rtol=0, atol=0)
    assert out["spm"] == (spm_dir / "spm.model").read_bytes()
    assert out["config"] == TransformerConfig(vocab_size=vocab, **TINY_MODEL).to_dict()
    model = Transformer(TransformerConfig.from_dict(out["config"]))
    model.load_state_dict(out["model"])  # strict: every key fits
    assert metrics.checkpoints == ["step-00000010", "step-00000015"]
    assert metrics.used == 2 and not metrics.fewer_than_requested


def test_output_is_byte_identical_across_runs(tmp_path: Path, spm_dir: Path) -> None:
    vocab = spm_vocab_size(spm_dir / "spm.model")
    write_checkpoint(tmp_path / "train", 1, tiny_model(vocab, 1).state_dict())
    write_checkpoint(tmp_path / "train", 2, tiny_model(vocab, 2).state_dict())
    _run(tmp_path, spm_dir, last_n=2)
    first = hashlib.sha256((tmp_path / "model" / AVERAGED_NAME).read_bytes()).hexdigest()
    _run(tmp_path, spm_dir, last_n=2)
    assert hashlib.sha256((tmp_path / "model" / AVERAGED_NAME).read_bytes()).hexdigest() == first
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == [".nmt-output", AVERAGED_NAME]  # no temporary
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nor a temporary sibling


def test_integer_buffers_come_from_the_newest_and_floats_are_averaged_in_fp32(tmp_path: Path) -> None:
    old = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "n": torch.tensor([3, 4]),
           "mask": torch.tensor([True, False])}
    new = {"w": torch.tensor([2.0, 3.0], dtype=torch.bfloat16), "n": torch.tensor([7, 9]),
           "mask": torch.tensor([False, True])}
    avg = average_state_dicts([write_checkpoint(tmp_path, 1, old), write_checkpoint(tmp_path, 2, new)])
    assert avg["w"].dtype == torch.bfloat16
    assert avg["w"].tolist() == [1.5, 2.5]
    assert avg["n"].tolist() == [7, 9] and avg["n"].dtype == torch.int64
    assert avg["mask"].tolist() == [False, True]


def test_fewer_checkpoints_than_last_n_uses_what_exists_and_says_so(tmp_path: Path, spm_dir: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    vocab = spm_vocab_size(spm_dir / "spm.model")
    a = tiny_model(vocab, 1).state_dict()
    write_checkpoint(tmp_path / "train", 3, a)
    with caplog.at_level("WARNING"):
        out, metrics = _run(tmp_path, spm_dir, last_n=5)
    assert "only 1 complete checkpoint" in caplog.text
    assert metrics.requested == 5 and metrics.used == 1 and metrics.fewer_than_requested
    for key in a:
        assert torch.equal(out["model"][key], a[key])


@pytest.mark.parametrize(("change", "message"), [
    ("missing", r"step-00000002/model\.pt: key 'extra\.weight' is missing \(present in .*step-00000001"),
    ("extra", r"step-00000002/model\.pt: unexpected key 'surplus'"),
    ("shape", r"step-00000002/model\.pt: key 'extra\.weight' has shape \[3\]"),
])
def test_mismatched_checkpoints_name_the_checkpoint_and_key(tmp_path: Path, spm_dir: Path, change: str,
                                                            message: str) -> None:
    first = {"extra.weight": torch.zeros(2), "b": torch.ones(1)}
    second = dict(first)
    if change == "missing":
        del second["extra.weight"]
    elif change == "extra":
        second["surplus"] = torch.zeros(1)
    else:
        second["extra.weight"] = torch.zeros(3)
    write_checkpoint(tmp_path / "train", 1, first)
    write_checkpoint(tmp_path / "train", 2, second)
    with pytest.raises(CheckpointError, match=message):
        _run(tmp_path, spm_dir, last_n=2)
    assert not (tmp_path / "model").exists() or not any((tmp_path / "model").iterdir())


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path: Path, spm_dir: Path) -> None:
    vocab = spm_vocab_size(spm_dir / "spm.model")
    write_checkpoint(tmp_path / "train", 1, tiny_model(vocab + 8, 1).state_dict())  # another vocabulary
    with pytest.raises(CheckpointError, match=r"does not fit the model built from state\.json's config"):
        _run(tmp_path, spm_dir, last_n=1)
    assert not (tmp_path / "model" / AVERAGED_NAME).exists()


def test_state_json_vocabulary_must_match_spm(tmp_path: Path, spm_dir: Path) -> None:
    vocab = spm_vocab_size(spm_dir / "spm.model")
    model = tiny_model(vocab + 8, 1)
    write_checkpoint(tmp_path / "train", 1, model.state_dict(), model.cfg.to_dict())
    with pytest.raises(CheckpointError, match=rf"state\.json: the model was trained with vocabulary size {vocab + 8}, "
                                              rf"but spm\.model has {vocab} pieces"):
        _run(tmp_path, spm_dir, last_n=1)


def test_corrupt_checkpoint_and_no_checkpoint_are_clear_errors(tmp_path: Path, spm_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="no complete checkpoint .* run the train stage"):
        _run(tmp_path, spm_dir, last_n=1)
    folder = write_checkpoint(tmp_path / "train", 1, {"w": torch.zeros(1000)})
    data = (folder / "model.pt").read_bytes()
    (folder / "model.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"step-00000001/model\.pt: truncated \(\d+ of the \d+ bytes written"):
        _run(tmp_path, spm_dir, last_n=1)
    assert not (tmp_path / "model" / AVERAGED_NAME).exists()


def _saved_checkpoint(train_dir: Path, step: int, model: Transformer) -> Path:
    """A checkpoint written by the train stage's own writer (state.json records sizes and sha256)."""
    from pipeline.artifacts import checkpoint

    state = {"step": step, "config": {"model": model.cfg.to_dict(), "train": {}, "seed": 1}}
    return checkpoint.save(train_dir, step, model_state=model.state_dict(), optim_state={}, state=state,
                           keep_last=100)


def test_flipped_bytes_in_a_checkpoint_are_refused_naming_file_and_remedy(tmp_path: Path, spm_dir: Path) -> None:
    from tests.helpers.corruption import flip_in_largest_record

    vocab = spm_vocab_size(spm_dir / "spm.model")
    for step in (1, 2):
        folder = _saved_checkpoint(tmp_path / "train", step, tiny_model(vocab, step))
    flip_in_largest_record(folder / "model.pt")
    with pytest.raises(CheckpointError, match=r"step-00000002/model\.pt: content does not match the sha256 recorded "
                                              r"at save .*delete the folder .*step-00000002 .*rerun `dvc repro "
                                              r"--force --single-item train && dvc repro average`: train resumes from "
                                              r"step-00000001 and trains step-00000002 again; average then averages "
                                              r"the last 2 complete checkpoints$"):
        _run(tmp_path, spm_dir, last_n=2)
    assert not (tmp_path / "model" / AVERAGED_NAME).exists()


RERUN = "rerun `dvc repro --force --single-item train && dvc repro average`: train resumes from"
LAST_2 = "average then averages the last 2 complete checkpoints"


@pytest.mark.parametrize(("corrupt", "then"), [
    (2, f"{RERUN} step-00000003 and does not write step-00000002 again; {LAST_2} (step-00000001, step-00000003, "
        "unless train goes on past step-00000003)"),
    (3, f"{RERUN} step-00000002 and trains step-00000003 again; {LAST_2}")])
def test_the_remedy_for_a_corrupt_checkpoint_says_what_the_rerun_trains_and_averages(tmp_path: Path, spm_dir: Path, corrupt: int,
                                                                         then: str) -> None:
    from tests.helpers.corruption import flip_in_largest_record

    vocab = spm_vocab_size(spm_dir / "spm.model")
    folders = {step: _saved_checkpoint(tmp_path / "train", step, tiny_model(vocab, step)) for step in (1, 2, 3)}
    flip_in_largest_record(folders[corrupt] / "model.pt")
    with pytest.raises(CheckpointError) as info:
        _run(tmp_path, spm_dir, last_n=2)
    assert str(info.value) == (
        f"{folders[corrupt] / 'model.pt'}: content does not match the sha256 recorded at save (bit rot, a bad copy "
        f"or an edit?); delete the folder {folders[corrupt]} (or move it away) and {then}")


def test_a_renamed_sha256_key_in_state_json_is_refused_not_skipped(tmp_path: Path, spm_dir: Path) -> None:
    import json

    from tests.helpers.corruption import flip_in_largest_record

    vocab = spm_vocab_size(spm_dir / "spm.model")
    folder = _saved_checkpoint(tmp_path / "train", 1, tiny_model(vocab, 1))
    state = json.loads((folder / "state.json").read_text())
    state["files"]["model.pt"]["sha257"] = state["files"]["model.pt"].pop("sha256")
    (folder / "state.json").write_text(json.dumps(state))
    flip_in_largest_record(folder / "model.pt")
    with pytest.raises(CheckpointError) as info:
        _run(tmp_path, spm_dir, last_n=1)
    assert str(info.value) == (
        f"{folder / 'state.json'}: no files.model.pt.sha256 recorded, so model.pt cannot be checked (written by an "
        f"older version, or edited); delete the folder {folder} (or move it away) and retrain (`dvc repro train`): "
        "it is the only complete checkpoint")
    assert not (tmp_path / "model" / AVERAGED_NAME).exists()


def test_the_remedy_for_the_newest_checkpoint_without_its_sha256_says_the_rerun_trains_it_again(
        tmp_path: Path, spm_dir: Path) -> None:
    import json

    vocab = spm_vocab_size(spm_dir / "spm.model")
    folders = [_saved_checkpoint(tmp_path / "train", step, tiny_model(vocab, step)) for step in (1, 2)]
    state = json.loads((folders[1] / "state.json").read_text())
    del state["files"]["model.pt"]["sha256"]
    (folders[1] / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError) as info:
        _run(tmp_path, spm_dir, last_n=2)
    assert str(info.value) == (
        f"{folders[1] / 'state.json'}: no files.model.pt.sha256 recorded, so model.pt cannot be checked (written by "
        f"an older version, or edited); delete the folder {folders[1]} (or move it away) and {RERUN} step-00000001 "
        f"and trains step-00000002 again; {LAST_2}")
    assert not (tmp_path / "model" / AVERAGED_NAME).exists()


def test_averaged_file_is_byte_identical_with_hashes_recorded(tmp_path: Path, spm_dir: Path) -> None:
    vocab = spm_vocab_size(spm_dir / "spm.model")
    _saved_checkpoint(tmp_path / "train", 1, tiny_model(vocab, 1))
    _run(tmp_path, spm_dir, last_n=1)
    first = (tmp_path / "model" / AVERAGED_NAME).read_bytes()
    _run(tmp_path, spm_dir, last_n=1)
    assert (tmp_path / "model" / AVERAGED_NAME).read_bytes() == first


def test_a_folder_without_done_inside_the_window_is_named_and_skipped(tmp_path: Path, spm_dir: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    vocab = spm_vocab_size(spm_dir / "spm.model")
    for step in (500, 550, 575, 600):
        write_checkpoint(tmp_path / "train", step, tiny_model(vocab, step).state_dict(), done=step != 575)
    write_checkpoint(tmp_path / "train", 450, tiny_model(vocab, 450).state_dict(), done=False)  # outside: not named
    with caplog.at_level("WARNING"):
        _, metrics = _run(tmp_path, spm_dir, last_n=3)
    assert metrics.checkpoints == ["step-00000500", "step-00000550", "step-00000600"]
    assert metrics.skipped_incomplete == ["step-00000575"]
    warning = [r.getMessage() for r in caplog.records if "step-00000575" in r.getMessage()]
    assert warning and "no DONE" in warning[0] and "step-00000500" in warning[0], caplog.text
    assert "step-00000450" not in caplog.text
    _, metrics = _run(tmp_path, spm_dir, last_n=1)
    assert metrics.skipped_incomplete == []
