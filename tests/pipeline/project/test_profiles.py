"""Switching profiles never loses a hand-edited params.yaml."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.project.profiles import write_profile
from tests.helpers.paths import REPO


@pytest.fixture
def root(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    write_profile("paper", tmp_path)
    return tmp_path


def test_a_generated_params_yaml_is_replaced_without_a_backup(root: Path) -> None:
    write_profile("tiny", root)
    write_profile("demo", root)
    write_profile("paper", root)
    assert not list(root.glob("params.yaml.*"))


def test_a_hand_edited_params_yaml_is_kept_as_a_backup(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    params = root / "params.yaml"
    edited = params.read_text(encoding="utf-8").replace("warmup_steps: 4000", "warmup_steps: 8000")
    params.write_text(edited, encoding="utf-8")
    write_profile("demo", root)
    (backup,) = root.glob("params.yaml.*.bak")
    assert backup.read_text(encoding="utf-8") == edited
    assert "profile: demo" in params.read_text(encoding="utf-8")
    assert f"params.yaml had edits that no profile produces; kept them in {backup}" in caplog.text
