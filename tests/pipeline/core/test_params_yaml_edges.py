"""params.yaml values that the stages and DVC once read differently, or that ended in a traceback: each is one
line through a stage's real command, before the stage writes anything."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dvc.utils.serialize import YAMLFileCorruptedError, parse_yaml

from pipeline.project.profiles import merged_profile


def _tiny_text(repo_root: Path) -> str:
    params = merged_profile("tiny", repo_root)
    params["evaluate"]["beam_sizes"] = [1]
    return yaml.safe_dump(params, sort_keys=False)


def _stage_error(folder: Path, text: str) -> str:
    """``python -m pipeline.download --params params.yaml`` in ``folder`` with ``text`` as the file: its stderr
    (the download stage reads the whole params file first, as every stage does)."""
    (folder / "params.yaml").write_text(text, encoding="utf-8")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NMT_")}, "NMT_TRACKING": "off"}
    run = subprocess.run([sys.executable, "-m", "pipeline.download", "--params", "params.yaml"], cwd=folder,
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1 and sorted(p.name for p in folder.iterdir()) == ["params.yaml"], run.stderr
    return run.stderr


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_a_duplicate_key_is_one_line_naming_it_and_its_lines_as_dvc_refuses_it(repo_root: Path,
                                                                                tmp_path: Path) -> None:
    """PyYAML keeps the last of two ``max_steps``, so the stage trained 60 while DVC refused the file."""
    text = _tiny_text(repo_root).replace("  max_steps: ", "  max_steps: 60\n  max_steps: ", 1)
    first = _line_of(text, "  max_steps: 60")
    assert _stage_error(tmp_path, text) == (
        f"error: stage download: params.yaml: line {first + 1}, column 3: duplicate key 'max_steps' (first on "
        f"line {first}); DVC refuses such a file: keep one\n")
    with pytest.raises(YAMLFileCorruptedError):  # what `dvc status` / `dvc repro` read
        parse_yaml(text, "params.yaml")


def test_a_base_60_number_is_text_as_for_dvc_so_an_integer_key_refuses_it(repo_root: Path, tmp_path: Path) -> None:
    """YAML 1.1 reads ``1:20`` as 80 (PyYAML did); DVC's YAML 1.2 reads the text '1:20', recorded in dvc.lock."""
    text = re.sub(r"(?m)^  max_steps: .*$", "  max_steps: 1:20", _tiny_text(repo_root), count=1)
    assert parse_yaml(text, "params.yaml")["train"]["max_steps"] == "1:20"
    assert _stage_error(tmp_path, text) == ("error: stage download: params.yaml: train.max_steps: expected int, got "
                                            "str '1:20'\n")


@pytest.mark.parametrize(("key", "values", "shown"), [("beam_sizes", [1, 1, 1], "1 appears 3 times"),
                                                      ("alphas", [0.6, 1.0, 0.6], "0.6 appears 2 times")])
def test_a_repeated_grid_value_is_one_line_naming_the_key(repo_root: Path, tmp_path: Path, key: str,
                                                          values: list, shown: str) -> None:
    """``beam_sizes: [1, 1, 1]`` decoded the valid set three times for one answer."""
    params = yaml.safe_load(_tiny_text(repo_root))
    params["evaluate"][key] = values
    assert _stage_error(tmp_path, yaml.safe_dump(params, sort_keys=False)) == (
        f"error: stage download: params.yaml: evaluate: evaluate.{key}: {shown}, and each decodes the whole valid "
        "set again; list each value once\n")


def test_an_alpha_past_the_servers_bound_is_one_line(repo_root: Path, tmp_path: Path) -> None:
    """``alphas: [1000.0]`` ended evaluate in an OverflowError of ((5 + n) / 6) ** alpha."""
    params = yaml.safe_load(_tiny_text(repo_root))
    params["evaluate"]["alphas"] = [0.6, 1000.0]
    assert _stage_error(tmp_path, yaml.safe_dump(params, sort_keys=False)) == (
        "error: stage download: params.yaml: evaluate.alphas[1]: 1000.0 is out of range (expected <= 10)\n")


def test_a_nul_byte_in_a_path_is_one_line_naming_the_key(repo_root: Path, tmp_path: Path) -> None:
    """A NUL byte in ``paths.train`` was a ValueError traceback (embedded null byte) from os.path."""
    params = yaml.safe_load(_tiny_text(repo_root))
    params["paths"]["train"] = "runs/tiny/tr\0ain"
    assert _stage_error(tmp_path, yaml.safe_dump(params, sort_keys=False)) == (
        "error: stage download: params.yaml: paths.train: 'runs/tiny/tr\\x00ain' holds a NUL byte, which no file "
        "name may hold; remove it\n")
