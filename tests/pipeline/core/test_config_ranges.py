"""params.yaml values out of their valid range, and paths outside the repository's output folders, are
refused at load: one ConfigError line per problem, each naming the dotted key."""

from __future__ import annotations

import typing
from pathlib import Path

import annotated_types
import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pipeline.core import config
from pipeline.core.config import Params, params_from_dict
from pipeline.core.errors import ConfigError
from pipeline.project.profiles import merged_profile, profile_names
from tests.helpers.paths import REPO


def _paper(repo_root: Path) -> dict:
    return yaml.safe_load((repo_root / "profiles" / "paper.yaml").read_text(encoding="utf-8"))


def _set(data: dict, dotted: str, value: object) -> dict:
    *sections, key = dotted.split(".")
    node = data
    for section in sections:
        node = node[section]
    node[key] = value
    return data


def _only_problem(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        params_from_dict(data)
    assert len(info.value.problems) == 1, info.value.problems
    return info.value.problems[0]


@pytest.mark.parametrize(
    ("dotted", "value", "named"),
    [
        # the red-team findings
        ("train.lr_scale", -1.0, "train.lr_scale"),
        ("train.max_epochs", -3, "train.max_epochs"),
        ("evaluate.max_tokens", -5, "evaluate.max_tokens"),
        ("evaluate.max_len_b", -10, "evaluate.max_len_b"),
        ("evaluate.alphas", [-5], "evaluate.alphas[0]"),
        ("model.n_layers", 0, "model.n_layers"),
        ("train.adam_eps", -1, "train.adam_eps"),
        ("train.adam_beta1", 5, "train.adam_beta1"),
        # one of each other section, and values that are not numbers at all
        ("seed", -1, "seed"),
        ("download.retries", -1, "download.retries"),
        ("download.timeout_s", 0, "download.timeout_s"),
        ("clean.min_words", 0, "clean.min_words"),
        ("clean.max_ratio", 0.5, "clean.max_ratio"),
        ("bpe.vocab_size", 4, "bpe.vocab_size"),
        ("bpe.input_sentence_size", -1, "bpe.input_sentence_size"),
        ("bpe.character_coverage", 0.0, "bpe.character_coverage"),
        ("bpe.seed", -2, "bpe.seed"),
        ("encode.max_len", 0, "encode.max_len"),
        ("encode.shard_rows", 0, "encode.shard_rows"),
        ("model.d_model", -512, "model.d_model"),
        ("model.dropout", 1.0, "model.dropout"),
        ("model.max_positions", 0, "model.max_positions"),
        ("train.adam_beta2", 1.0, "train.adam_beta2"),
        ("train.weight_decay", -0.1, "train.weight_decay"),
        ("train.label_smoothing", 1.0, "train.label_smoothing"),
        ("train.clip_norm", -1.0, "train.clip_norm"),
        ("train.max_minutes", -1, "train.max_minutes"),
        ("train.lr_scale", float("inf"), "train.lr_scale"),
        ("train.lr_scale", float("nan"), "train.lr_scale"),
        ("average.last_n", 0, "average.last_n"),
        ("evaluate.beam_sizes", [4, 0], "evaluate.beam_sizes[1]"),
        ("evaluate.beam_sizes", [500], "evaluate.beam_sizes[0]"),  # wider than model.config.MAX_BEAM_SIZE
        ("evaluate.max_len_a", -1.0, "evaluate.max_len_a"),
    ],
)
def test_out_of_range_values_are_one_line_naming_the_key(repo_root: Path, dotted: str, value: object,
                                                         named: str) -> None:
    problem = _only_problem(_set(_paper(repo_root), dotted, value))
    assert problem.startswith(f"{named}: "), problem
    assert "\n" not in problem and ("out of range" in problem or "not a finite number" in problem), problem


@pytest.mark.parametrize(
    ("dotted", "value"),
    [("model.d_model", 10**12), ("model.d_ff", 10**12), ("model.n_layers", 10**9), ("model.max_positions", 10**12),
     ("bpe.vocab_size", 10**12), pytest.param("model.d_model", 2**4096, id="model.d_model-2^4096")],
)
def test_a_model_too_large_to_train_is_refused_naming_the_key(repo_root: Path, dotted: str, value: int) -> None:
    """``model.d_model: 1e12`` passed the params check and died in training naming no key."""
    problem = _only_problem(_set(_paper(repo_root), dotted, value))
    assert problem.startswith(f"params: {dotted}: ") and f"lower {dotted}" in problem, problem
    assert "\n" not in problem and len(problem) < 400, problem  # the value shown cut short, never whole


def test_the_papers_big_model_is_not_too_large(repo_root: Path) -> None:
    data = _paper(repo_root)
    data["model"].update(d_model=1024, n_heads=16, d_ff=4096, n_layers=6)
    assert params_from_dict(data).model.weight_count(37000) > 213e6


def test_a_beam_wider_than_the_vocabulary_is_refused_naming_evaluate_beam_sizes(repo_root: Path) -> None:
    """With a 300-piece vocabulary, ``evaluate.beam_sizes: [500]`` trained and then died in evaluate."""
    data = _set(_set(_paper(repo_root), "bpe.vocab_size", 32), "evaluate.beam_sizes", [4, 40])
    problem = _only_problem(data)
    assert problem.startswith("params: evaluate.beam_sizes[1]: 40 must be at most the vocabulary size (32 pieces)")
    assert "bpe.vocab_size" in problem
    params_from_dict(_set(data, "evaluate.beam_sizes", [4, 32]))


def test_the_red_team_example_reads_as_documented(repo_root: Path) -> None:
    problem = _only_problem(_set(_paper(repo_root), "train.lr_scale", -1.0))
    assert problem == "train.lr_scale: -1.0 is out of range (expected > 0)"


def test_every_range_problem_is_reported_together(repo_root: Path) -> None:
    data = _paper(repo_root)
    for dotted, value in (("train.lr_scale", -1.0), ("model.n_layers", 0), ("evaluate.max_tokens", -5),
                          ("paths.eval", "docs"), ("train.tokens_per_step", "lots")):
        _set(data, dotted, value)
    with pytest.raises(ConfigError) as info:
        params_from_dict(data)
    keys = sorted(p.split(":")[0] for p in info.value.problems)
    assert keys == ["evaluate.max_tokens", "model.n_layers", "paths.eval", "train.lr_scale",
                    "train.tokens_per_step"], info.value.problems


@pytest.mark.parametrize(
    ("dotted", "value"),
    [("train.max_epochs", 0), ("train.clip_norm", 0), ("train.max_minutes", 0), ("train.weight_decay", 0),
     ("train.adam_beta1", 0.0), ("bpe.input_sentence_size", 0), ("bpe.character_coverage", 1.0),
     ("evaluate.max_len_b", 0), ("evaluate.max_len_a", 0), ("evaluate.alphas", [0.0, 1.0]), ("seed", 0),
     ("download.retries", 0), ("model.dropout", 0.0)],
)
def test_range_edges_that_mean_something_are_accepted(repo_root: Path, dotted: str, value: object) -> None:
    params_from_dict(_set(_paper(repo_root), dotted, value))


def _numeric_fields(cls: type[BaseModel] = Params, prefix: str = "") -> typing.Iterator[tuple[str, FieldInfo]]:
    for name, info in cls.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            yield from _numeric_fields(info.annotation, f"{prefix}{name}.")
        elif _is_numeric(info.annotation):
            yield f"{prefix}{name}", info


def _is_numeric(tp: typing.Any) -> bool:
    if typing.get_origin(tp) in (list, dict, typing.Annotated):
        return any(_is_numeric(a) for a in typing.get_args(tp))
    return tp in (int, float)


def _bounded(info: FieldInfo) -> bool:
    """A bound on the field itself, or on each item of a list."""
    found = [m for m in info.metadata if isinstance(m, (annotated_types.Ge, annotated_types.Gt, annotated_types.Le,
                                                          annotated_types.Lt))]
    items = typing.get_args(info.annotation)
    return bool(found) or any(typing.get_origin(a) is typing.Annotated and len(typing.get_args(a)) > 1
                              for a in items)


def test_every_numeric_key_has_a_range() -> None:
    """A new numeric key in any section cannot slip past: its field needs a bound."""
    numeric = list(_numeric_fields())
    assert len(numeric) > 40  # the walk reaches every section, model included
    missing = [dotted for dotted, info in numeric if not _bounded(info)]
    assert not missing, f"numeric keys without a range in pipeline/core/config.py: {missing}"
    stale = sorted(set(config.MODEL_RANGES) - set(config.ModelSection.model_fields))
    assert not stale, f"MODEL_RANGES names keys that are not model settings: {stale}"


def test_every_profile_still_loads(repo_root: Path) -> None:
    names = profile_names(repo_root)
    assert {"paper", "demo", "tiny"} <= set(names)
    for name in names:
        params_from_dict(merged_profile(name, repo_root), name)


PATH_RULE = "relative path without '..' inside one of data/, runs/, metrics/, plots/, reports/"


@pytest.mark.parametrize(
    "value",
    ["docs", "../outside_eval", str(REPO / "docs"), str(REPO / "runs" / "x"), "/tmp/../tmp/eval", "runs/../docs", "runs/paper/../../docs", "runs", "data/", ".",
     "", "src/eval", "./docs", "~/eval", "C:/eval"],
)
def test_paths_outside_the_output_folders_are_refused(repo_root: Path, value: str) -> None:
    problem = _only_problem(_set(_paper(repo_root), "paths.eval", value))
    assert problem.startswith(f"paths.eval: {value!r} "), problem
    assert PATH_RULE in problem and "\n" not in problem, problem


@pytest.mark.parametrize("key", ["raw", "clean", "bpe", "shards", "train", "model", "eval", "metrics", "plots",
                                 "reports"])
def test_every_path_key_is_checked(repo_root: Path, key: str) -> None:
    problem = _only_problem(_set(_paper(repo_root), f"paths.{key}", "docs"))
    assert problem.startswith(f"paths.{key}: 'docs' "), problem


def test_an_absolute_path_outside_the_checkout_is_accepted(repo_root: Path, tmp_path: Path) -> None:
    """Another disk (a scratch file system) is a deliberate choice, not a slip."""
    params_from_dict(_set(_paper(repo_root), "paths.shards", str(tmp_path / "shards")))


def test_paths_inside_the_output_folders_are_accepted(repo_root: Path) -> None:
    data = _paper(repo_root)
    for key, value in (("raw", "data/x/raw"), ("eval", "runs/a/b/eval"), ("metrics", "metrics/x"),
                       ("plots", "plots/x"), ("reports", "reports/x"), ("train", "runs/./x/train")):
        data["paths"][key] = value
    params_from_dict(data)
