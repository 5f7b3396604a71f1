"""The stages' details records: typed reads of ``<stage>.details.json``, one-line errors, nothing lost."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.core import stages
from pipeline.core.details import (METRICS, RECORDS, EvaluateDetails, GridPoint, RunDetails, SetFigures,
                                   StageDetails, TrainDetails)
from pipeline.core.errors import DataError, PipelineError
from pipeline.inference.scoring import METRIC_KEYS
from pipeline.tracking.harness import run_stage


def test_one_record_per_stage_and_the_scorer_s_metrics() -> None:
    assert tuple(RECORDS) == stages.NAMES
    assert METRICS == METRIC_KEYS


def test_missing_file_key_or_null_reads_as_absent(tmp_path: Path) -> None:
    assert TrainDetails.read(tmp_path) is None and RunDetails.read(tmp_path) == RunDetails()
    stages.details_file(tmp_path, "train").write_text(json.dumps({"step": 7, "resumed_from_step": None}))
    train = TrainDetails.read(tmp_path)
    assert train is not None and (train.step, train.resumed_from_step, train.device) == (7, None, None)
    assert RunDetails.read(tmp_path).run_ids() == {"train": None}


def test_round_trip_keeps_every_key() -> None:
    grid = [{"beam": 4, "alpha": 0.6, "bleu": 25.0, "decode_seconds": 2.0}]
    data = {"test": {"bleu": 27.9, "sentences": 1000, "signatures": {"bleu": "nrefs:1"}, "later": {"bleu": "x"}},
            "chosen": {"beam": 4, "alpha": 0.6, "chosen_on": "valid"}, "grid": grid, "seconds": 1.5, "newer": [1]}
    record = EvaluateDetails.from_json(data, "e.json")  # a file from another version: unknown keys kept
    assert record.test.bleu == 27.9 and record.test.extra == {"later": {"bleu": "x"}} and record.valid.bleu is None
    assert record.extra == {"newer": [1]} and record.grid == [GridPoint(beam=4, alpha=0.6, bleu=25.0, decode_seconds=2)]
    assert EvaluateDetails.from_json(record.to_json(), "e.json") == record
    assert record.replace(device="cpu").extra == {"newer": [1]}  # a record read keeps its unknown keys
    written = record.to_json()  # every field, an unset one as null (empty sets: every figure null)
    assert written.keys() == data.keys() | set(EvaluateDetails.model_fields)
    assert written["device"] is None and written["valid"]["bleu"] is None and written["test"]["later"] == {"bleu": "x"}


@pytest.mark.parametrize("record", [*RECORDS.values(), SetFigures], ids=lambda c: c.__name__)
def test_a_writer_naming_an_undeclared_field_is_an_error(record: type[StageDetails]) -> None:
    with pytest.raises(ValidationError, match=f"{record.__name__} declares no field bogus"):
        record(bogus=1)
    with pytest.raises(ValidationError, match="SetFigures declares no field bogus"):
        EvaluateDetails(test=SetFigures(bleu=1.0)).replace(valid={"bogus": 1})
    assert not record().extra


@pytest.mark.parametrize("name", stages.NAMES)
def test_each_stage_writes_its_record_and_only_declared_keys(name: str, tmp_path: Path) -> None:
    returned = run_stage(name, RECORDS[name], metrics_dir=tmp_path)
    read = RECORDS[name].read(tmp_path)
    assert read == returned and not read.extra and returned.seconds is not None
    assert set(json.loads(stages.details_file(tmp_path, name).read_text())) == set(RECORDS[name].model_fields)


def test_the_harness_takes_only_records(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="stage clean returned a dict, not its StageDetails record"):
        run_stage("clean", lambda: {"train": {}}, metrics_dir=tmp_path)  # type: ignore[arg-type, return-value]
    assert not stages.details_file(tmp_path, "clean").exists()


@pytest.mark.parametrize(("content", "message"), [
    ({"test": {"bleu": "27.9"}}, 'test.bleu: expected a number, got "27.9"'),
    ({"test": [1]}, "test: expected a JSON object, got list"),
    ({"chosen": {"beam": True}}, "chosen.beam: expected an integer, got true"),
    ({"valid": {"signatures": {"bleu": 1}}}, "valid.signatures.bleu: expected a string, got 1"),
    ({"grid": [1], "valid_newest": {"step": 2.5}}, "valid_newest.step: expected an integer, got 2.5"),
    ([1], "expected a JSON object, got list"),
])
def test_a_wrong_type_is_one_line_naming_file_and_key(tmp_path: Path, content: object, message: str) -> None:
    path = stages.details_file(tmp_path, "evaluate")
    path.write_text(json.dumps(content))
    with pytest.raises(DataError, match=re.escape(f"{path}: {message}")) as info:
        EvaluateDetails.read(tmp_path)
    assert "\n" not in str(info.value)


def test_invalid_json_names_the_file(tmp_path: Path) -> None:
    stages.details_file(tmp_path, "average").write_text("{")
    with pytest.raises(PipelineError, match="average.details.json: not valid JSON"):
        RunDetails.read(tmp_path)
