"""params.yaml loading: every bad key reported at once, cross-field rules, profiles."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import Params, flatten, load_params, params_from_dict, section_dict
from pipeline.core.errors import ConfigError
from pipeline.project.profiles import deep_merge, merged_profile, profile_names, write_profile


# Tests read profiles/paper.yaml, never the working tree's params.yaml (`nmt profile NAME` may have switched it).
def _paper(repo_root: Path) -> dict:
    return yaml.safe_load((repo_root / "profiles" / "paper.yaml").read_text(encoding="utf-8"))


def test_committed_params_yaml_is_the_paper_profile(repo_root: Path) -> None:
    committed = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=repo_root, capture_output=True, text=True,
                               check=False)
    if committed.returncode != 0:
        pytest.skip(f"not a git checkout with a committed params.yaml: {committed.stderr.strip()}")
    assert committed.stdout == (repo_root / "profiles" / "paper.yaml").read_text(encoding="utf-8")
    p = load_params(repo_root / "profiles" / "paper.yaml")
    assert isinstance(p, Params)
    assert (p.model.d_model, p.model.n_heads, p.model.d_ff, p.model.n_layers) == (512, 8, 2048, 6)
    assert (p.train.warmup_steps, p.train.tokens_per_step, p.train.label_smoothing) == (4000, 25000, 0.1)
    assert (p.bpe.vocab_size, p.average.last_n, p.evaluate.beam_sizes, p.evaluate.alphas) == (37000, 5, [4], [0.6])
    assert p.model.pre_norm is False


def test_every_bad_key_is_named_in_one_error(repo_root: Path) -> None:
    data = _paper(repo_root)
    data["train"]["tokens_per_step"] = "lots"   # wrong type
    data["train"]["warmup"] = 10                # unknown key
    del data["model"]["d_model"]                # missing key
    data["clean"]["dedup"] = 1                  # int is not bool
    data["evaluate"]["beam_sizes"] = [4, "x"]   # wrong item type
    data["mystery"] = {}                        # unknown section
    with pytest.raises(ConfigError) as info:
        params_from_dict(data, "params.yaml")
    msg = str(info.value)
    for key in ("train.tokens_per_step", "train.warmup: unknown key", "model.d_model: missing key", "clean.dedup",
                "evaluate.beam_sizes[1]", "mystery: unknown key"):
        assert key in msg, (key, msg)
    assert len(info.value.problems) == 6
    assert msg.startswith("params.yaml: 6 problem(s)")


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("train", "warmup_steps", 200000, "train.warmup_steps (200000) must be >= 1 and < train.max_steps"),
        ("train", "tokens_per_step", 100, "train.tokens_per_step (100) must be >= encode.max_len + 1 (257)"),
        ("train", "max_tokens", 8192, "train.max_tokens: moved to the environment variable NMT_MAX_TOKENS"),
        ("model", "n_heads", 7, "model: invalid TransformerConfig: d_model (512) must be divisible by n_heads (7)"),
        ("download", "dataset", "wmt15", "download.dataset: 'wmt15' is not one of 'wmt14' or 'multi30k'"),
        ("evaluate", "beam_rule", "T2T", "evaluate.beam_rule: 'T2T' is not one of 'fairseq' or 't2t'"),
        ("clean", "max_ratio", 0.5, "clean.max_ratio: 0.5 is out of range (expected >= 1)"),
        ("clean", "min_words", 300, "clean: clean.min_words (300) must be <= clean.max_words (250)"),
    ],
)
def test_impossible_combinations_are_refused(repo_root: Path, section: str, key: str, value: object,
                                             expected: str) -> None:
    data = _paper(repo_root)
    data[section][key] = value
    with pytest.raises(ConfigError, match=r".*") as info:
        params_from_dict(data)
    assert expected in str(info.value)


def test_the_model_section_is_the_networks_own_config(repo_root: Path) -> None:
    """params.yaml's model section validates into model.TransformerConfig; derived fields are not params."""
    from model import TransformerConfig

    params = params_from_dict(_paper(repo_root))
    assert isinstance(params.model, TransformerConfig) and params.model.vocab_size == 0
    data = _paper(repo_root)
    data["model"]["vocab_size"] = 37000
    with pytest.raises(ConfigError) as info:
        params_from_dict(data)
    assert "model.vocab_size: not a setting (it is the BPE model's piece count); remove it" in str(info.value)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(bad)


def test_alias_bomb_in_params_is_refused_with_one_line(repo_root: Path, tmp_path: Path) -> None:
    """Nested anchors in evaluate.alphas (6 levels: 531,441 items) are refused, never expanded into the error."""
    levels = ["[" + ", ".join(["0.6"] * 9) + "]", *(["[" + ", ".join([f"*a{i}"] * 9) + "]" for i in range(5)])]
    bomb = "[" + ", ".join(f"&a{i} {level}" for i, level in enumerate(levels)) + "]"
    text = (repo_root / "profiles" / "paper.yaml").read_text(encoding="utf-8")
    lines = text.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("  alphas:"))
    lines[row] = f"  alphas: {bomb}"
    (tmp_path / "params.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_params(tmp_path / "params.yaml")
    assert str(info.value) == (f"{tmp_path / 'params.yaml'}: line {row + 1}, column 12: YAML anchors and aliases "
                               "are not accepted (found &a0); write the value out in full")


def test_errors_show_a_bounded_rendering_of_any_value(repo_root: Path) -> None:
    """A huge value (here 10**7 shared items, built in memory) is shown in at most 80 characters."""
    nested: list = [0.6] * 10
    for _ in range(6):
        nested = [nested] * 10
    data = _paper(repo_root)
    data["evaluate"]["alphas"] = [nested]
    data["evaluate"]["beam_sizes"] = "x" * 100_000
    data["train"]["k" * 100_000] = 1
    with pytest.raises(ConfigError) as info:
        params_from_dict(data)
    problems = info.value.problems
    assert len(problems) == 3 and all(len(p) < 1000 for p in problems), problems
    assert any(p.startswith("evaluate.alphas[0]: expected float, got list [[[") and p.endswith("...")
               for p in problems), problems
    assert any(p.startswith("evaluate.beam_sizes: expected a list, got str 'xxx") for p in problems), problems
    assert any(p.startswith("train.kkk") and "...: unknown key" in p for p in problems), problems


def test_a_long_list_of_bad_items_is_counted_not_listed(repo_root: Path) -> None:
    data = _paper(repo_root)
    data["evaluate"]["alphas"] = ["x"] * 100_000
    data["train"][3] = "a key that is not text"
    with pytest.raises(ConfigError) as info:
        params_from_dict(data)
    problems = info.value.problems
    assert len(problems) == 30 and problems[-1] == "... and 99972 more problem(s) like these"
    assert any(p.startswith("train.3: unknown key, and not text") for p in problems), problems
    assert "evaluate.alphas[0]: expected float, got str 'x'" in problems
    assert len(str(info.value)) < 5000


def test_ints_are_accepted_for_floats_and_flatten(repo_root: Path) -> None:
    p = load_params(repo_root / "profiles" / "paper.yaml")
    assert isinstance(p.train.max_minutes, float)
    flat = flatten({"train": section_dict(p.train), "seed": 1})
    assert flat["train.tokens_per_step"] == 25000 and flat["seed"] == 1


def test_profiles_merge_and_validate(repo_root: Path, tmp_path: Path) -> None:
    assert {"paper", "demo", "tiny"} <= set(profile_names(repo_root))
    demo = merged_profile("demo", repo_root)
    assert demo["download"]["dataset"] == "multi30k" and demo["bpe"]["vocab_size"] == 8000
    assert demo["train"]["adam_beta2"] == 0.98  # inherited from paper
    paths = [set(merged_profile(n, repo_root)["paths"].values()) for n in ("paper", "demo", "tiny")]
    assert not (paths[1] & paths[2]) and not (paths[0] & paths[1]) - {"data/wmt14/raw"}
    out = write_profile("tiny", repo_root, tmp_path / "params.yaml")
    assert load_params(out).profile == "tiny"
    with pytest.raises(ConfigError, match="no such profile 'huge'"):
        merged_profile("huge", repo_root)


def test_deep_merge_replaces_leaves_and_lists() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 2}
    assert deep_merge(base, {"a": {"c": [3]}}) == {"a": {"b": 1, "c": [3]}, "d": 2}
    assert base["a"]["c"] == [1, 2]
