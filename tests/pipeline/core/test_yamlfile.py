"""The YAML reader for files a person writes: no anchors or aliases, a size bound, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.core.errors import ConfigError
from pipeline.core.yamlfile import MAX_BYTES, load_yaml


def _refusal(path: Path, text: str | bytes) -> str:
    if isinstance(text, str):
        path.write_text(text, encoding="utf-8")
    else:
        path.write_bytes(text)
    with pytest.raises(ConfigError) as info:
        load_yaml(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message


def test_plain_yaml_loads_as_safe_load(tmp_path: Path) -> None:
    text = "a: 1\nb: [x, 2.5, null]\nc: {d: true}\n# comment\n"
    (tmp_path / "ok.yaml").write_text(text, encoding="utf-8")
    assert load_yaml(tmp_path / "ok.yaml") == yaml.safe_load(text)
    (tmp_path / "empty.yaml").write_text("", encoding="utf-8")
    assert load_yaml(tmp_path / "empty.yaml") is None


def test_every_yaml_file_of_the_project_loads(repo_root: Path) -> None:
    """The project's own YAML needs no anchors: refusing them breaks none of its files."""
    files = [*sorted((repo_root / "profiles").glob("*.yaml")), *sorted((repo_root / "sweeps").glob("*.yaml")),
             repo_root / "params.yaml", repo_root / "prefect.yaml", repo_root / "dvc.yaml"]
    for path in files:
        assert load_yaml(path) == yaml.safe_load(path.read_text(encoding="utf-8")), path


def test_alias_bomb_is_refused_at_its_first_anchor(tmp_path: Path) -> None:
    # 9 levels of 9 aliases each: 9**9 (387 million) items once expanded, from under 1 KB of text
    rows = ["alphas:", "  - &l0 [" + ", ".join(["0.6"] * 9) + "]"]
    rows += [f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    message = _refusal(tmp_path / "bomb.yaml", "seed: 1\n" + "\n".join(rows) + "\n")
    assert message == (f"{tmp_path / 'bomb.yaml'}: line 3, column 5: YAML anchors and aliases are not accepted "
                       "(found &l0); write the value out in full")


def test_an_alias_alone_is_named_too(tmp_path: Path) -> None:
    message = _refusal(tmp_path / "alias.yaml", "a: 1\nb: *nowhere\n")
    assert "line 2, column 4: YAML anchors and aliases are not accepted (found *nowhere)" in message


def test_a_file_over_the_bound_is_refused_unparsed(tmp_path: Path) -> None:
    message = _refusal(tmp_path / "big.yaml", "a: [" + "1, " * (MAX_BYTES // 3 + 1) + "1]\n")
    assert f"larger than {MAX_BYTES} bytes" in message
    (tmp_path / "small.yaml").write_text("a: [1, 2, 3]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="larger than 8 bytes"):
        load_yaml(tmp_path / "small.yaml", max_bytes=8)


@pytest.mark.parametrize(("text", "expected"), [
    ("a: [1, 2\n", "line 2, column 1: not valid YAML: while parsing a flow sequence: expected ',' or ']'"),
    ("a: 1\n  b: 2\n", "line 2, column 4: not valid YAML: mapping values are not allowed here; fix the file there"),
    ("a: \x00\n", "line 1, column 4: not valid YAML: unacceptable character #x0000"),
    (b"a: \xff\n", "invalid UTF-8 at byte 3; re-encode the file as UTF-8"),
    ("a: 1\nb: " + "9" * 5000 + "\n", "line 2, column 4: not valid YAML: cannot read this value (Exceeds the limit"),
    ("a: 2024-13-45\n", "line 1, column 4: not valid YAML: cannot read this value (month must be in 1..12)"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "not valid YAML: lists or mappings nested too deeply"),
])
def test_bad_files_give_one_line_naming_the_place(tmp_path: Path, text: str | bytes, expected: str) -> None:
    message = _refusal(tmp_path / "bad.yaml", text)
    assert expected in message
    assert len(message) < 300


def test_a_missing_file_is_left_to_the_caller(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_yaml(tmp_path / "absent.yaml")
