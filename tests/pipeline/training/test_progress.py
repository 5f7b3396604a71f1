"""A slow run prints a progress line at least once a minute between its ``log_every_steps`` lines; those lines are
console only, so the logged rows (``train.csv``, MLflow) do not depend on how fast the machine was."""

from __future__ import annotations

import logging

import pytest

from pipeline.training import logs
from tests.helpers.train import make_workspace, run_inprocess, tiny_params


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return make_workspace(tmp_path_factory.mktemp("ws"))


def test_progress_lines_between_log_lines_change_no_logged_row(workspace, tmp_path, monkeypatch, caplog):
    params = dict(max_steps=6, log_every_steps=3, valid_every_steps=6, save_every_steps=6)
    run_inprocess(tiny_params(tmp_path / "a", workspace, **params), tmp_path / "a")
    caplog.set_level(logging.INFO, logger="pipeline.training.logs")
    monkeypatch.setattr(logs, "QUIET_SECONDS", 0.0)  # every step is "a minute later"
    run_inprocess(tiny_params(tmp_path / "b", workspace, **params), tmp_path / "b")
    progress = [r.getMessage() for r in caplog.records if "over the last" in r.getMessage()]
    assert [line.split("/")[0] for line in progress] == ["step 1", "step 2", "step 4", "step 5"]
    assert all("tgt tok/s | ETA" in line for line in progress)
    assert (tmp_path / "a" / "plots" / "train.csv").read_text() == (tmp_path / "b" / "plots" / "train.csv").read_text()
