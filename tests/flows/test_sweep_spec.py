"""Sweep specs: expanded into variants, or refused before anything runs with one line naming the file and key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.sweep_spec import MAX_VARIANTS, SpecError, load_spec, variant_params
from pipeline.core.errors import ConfigError
from flows.sweep_work import SweepState, exp_run_command, overrides, set_param, shared_stages, sweep_dir
from pipeline.core.config import flatten, params_from_dict
from pipeline.project.profiles import merged_profile
from tests.helpers.paths import REPO


def _write(tmp_path: Path, spec: dict | str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path


def _refused(tmp_path: Path, spec: dict | str) -> str:
    path = _write(tmp_path, spec)
    with pytest.raises(SpecError) as err:
        load_spec(path, REPO)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message[len(f"{path}: "):]


def test_a_grid_is_the_cross_product_in_spec_order_with_the_shared_overrides(tmp_path: Path) -> None:
    spec = load_spec(_write(tmp_path, {"name": "wu", "profile": "tiny", "set": {"evaluate.beam_sizes": [1]},
                                       "grid": {"train.warmup_steps": [2, 8], "train.lr_scale": [0.5, 1.0]}}), REPO)
    assert (spec.name, spec.profile, spec.concurrency, spec.run_name) == ("wu", "tiny", 2, "sweep-wu")
    assert [v.name for v in spec.variants] == ["wu-1", "wu-2", "wu-3", "wu-4"]
    assert [v.overrides for v in spec.variants] == [
        {"train.warmup_steps": 2, "train.lr_scale": 0.5}, {"train.warmup_steps": 2, "train.lr_scale": 1.0},
        {"train.warmup_steps": 8, "train.lr_scale": 0.5}, {"train.warmup_steps": 8, "train.lr_scale": 1.0}]
    assert spec.variants[0].applied == {"evaluate.beam_sizes": [1], "train.warmup_steps": 2, "train.lr_scale": 0.5}
    assert spec.keys == ("train.warmup_steps", "train.lr_scale")
    params = variant_params(merged_profile("tiny", REPO), spec.variants[3].applied)
    assert (params["train"]["warmup_steps"], params["train"]["lr_scale"], params["evaluate"]["beam_sizes"]) == \
        (8, 1.0, [1])
    params_from_dict(params)
    assert merged_profile("tiny", REPO)["train"]["warmup_steps"] == 5  # the base is not modified
    assert exp_run_command("wu-2", spec.variants[1].applied) == [
        "dvc", "exp", "run", "--temp", "--name", "wu-2", "--set-param", "evaluate.beam_sizes=[1]",
        "--set-param", "train.warmup_steps=2", "--set-param", "train.lr_scale=1.0"]


def test_seeds_cross_every_variant_or_alone_the_base_profile(tmp_path: Path) -> None:
    crossed = load_spec(_write(tmp_path, {"name": "s", "profile": "tiny", "grid": {"train.warmup_steps": [2, 8]},
                                          "seeds": [1, 7]}), REPO)
    assert [v.label() for v in crossed.variants] == ["train.warmup_steps=2, seed=1", "train.warmup_steps=2, seed=7",
                                                     "train.warmup_steps=8, seed=1", "train.warmup_steps=8, seed=7"]
    assert crossed.keys == ("train.warmup_steps", "seed")
    alone = load_spec(_write(tmp_path, {"name": "s", "profile": "tiny", "seeds": [1, 2, 3]}), REPO)
    assert [v.applied for v in alone.variants] == [{"seed": 1}, {"seed": 2}, {"seed": 3}] and alone.keys == ("seed",)


def test_a_list_of_variants_keeps_its_order_and_labels(tmp_path: Path) -> None:
    spec = load_spec(_write(tmp_path, {"name": "ab", "profile": "demo", "concurrency": 1, "variants": [
        {"train.warmup_steps": 100}, {"train.warmup_steps": 200, "model.dropout": 0.2}]}), REPO)
    assert [v.label() for v in spec.variants] == ["train.warmup_steps=100",
                                                  "train.warmup_steps=200, model.dropout=0.2"]
    assert spec.keys == ("train.warmup_steps", "model.dropout") and spec.concurrency == 1
    assert set_param("paths.raw", "data/x") == 'paths.raw="data/x"'


@pytest.mark.parametrize(("spec", "message"), [
    ({"name": "x", "profile": "tiny", "grid": {"train.warmup_steps": [1]}, "grdi": {}},
     "grdi: unknown key (known keys here: name, profile, concurrency, set, grid, variants, seeds)"),
    ({"name": "x", "profile": "tiny", "grid": {"train.warmpu_steps": [1, 2]}},
     "grid: train.warmpu_steps is not a param of params.yaml (known in train: tokens_per_step, lr_scale, "
     "warmup_steps, adam_beta1, adam_beta2, adam_eps, weight_decay, label_smoothing, clip_norm, max_steps, "
     "max_epochs, max_minutes, save_every_steps, keep_last, valid_every_steps, log_every_steps)"),
    ({"name": "x", "profile": "tiny", "grid": {"trian.lr_scale": [1]}},
     "grid: trian.lr_scale is not a param of params.yaml (known sections: profile, seed, paths, download, clean, "
     "bpe, encode, model, train, average, evaluate)"),
    ({"name": "x", "profile": "tiny", "variants": [{"train.warmup_steps": 1}, {"train": {"warmup_steps": 2}}]},
     "variants[1]: train is a section of params.yaml, not a param; name one key inside it, e.g. train.tokens_per_step"),
    ({"name": "x", "profile": "tiny", "set": {"evaluate.beem": 1}, "grid": {"train.warmup_steps": [1]}},
     "set: evaluate.beem is not a param of params.yaml (known in evaluate: beam_sizes, alphas, beam_rule, "
     "max_len_a, max_len_b, max_tokens)"),
    ({"name": "x", "profile": "tiny", "set": {"train.warmup_steps": 5, "train.max_steps": 20},
      "grid": {"train.lr_scale": [1.0], "train.warmup_steps": [1, 2]}},
     "set / grid: train.warmup_steps is in both, and the variant's value would replace the shared one; keep the key "
     "in one of them"),
    ({"name": "x", "profile": "tiny", "set": {"train.max_steps": 20},
      "variants": [{"train.warmup_steps": 1}, {"train.warmup_steps": 2, "train.max_steps": 30}]},
     "set / variants[1]: train.max_steps is in both, and the variant's value would replace the shared one; keep "
     "the key in one of them"),
    ({"name": "x", "profile": "tiny", "grid": {}},
     "grid: empty; give at least 1 item(s)"),
    ({"name": "x", "profile": "tiny", "grid": {"train.warmup_steps": []}},
     "grid.train.warmup_steps: empty; give at least 1 item(s)"),
    ({"name": "x", "profile": "tiny", "grid": {"train.warmup_steps": 5}},
     "grid.train.warmup_steps: expected a list, got int 5"),
    ({"name": "x", "profile": "tiny", "grid": {"train.warmup_steps": list(range(1, 9)),
                                               "train.max_steps": list(range(10, 19))}},
     f"grid: 8 x 9 = 72 variants, more than the limit of {MAX_VARIANTS}; split the sweep"),
    ({"name": "x", "profile": "tiny", "variants": [{"train.warmup_steps": i} for i in range(1, 66)]},
     f"variants: 65 variants, more than the limit of {MAX_VARIANTS}; split the sweep"),
    ({"name": "x", "profile": "tiny", "variants": []},
     "variants: empty; give at least 1 item(s)"),
    ({"name": "x", "profile": "tiny", "grid": {"train.warmup_steps": [10, "many"]}},
     "variant 2: train.warmup_steps: expected int, got str 'many' (profile tiny with train.warmup_steps=\"many\")"),
    ({"name": "x", "profile": "tiny", "grid": {"train.lr_scale": [1.0, -1.0]}},
     "variant 2: train.lr_scale: -1.0 is out of range (expected > 0) (profile tiny with train.lr_scale=-1.0)"),
    ({"name": "x", "profile": "tiny", "variants": [{"train.warmup_steps": 3}, {"train.warmup_steps": 3}]},
     "variants 1 and 2 are the same (train.warmup_steps=3)"),
    ({"name": "x", "profile": "tiny", "grid": {"train.warmup_steps": [1]}, "variants": [{"seed": 2}]},
     "grid / variants: give one of them (or seeds: alone: the base profile per seed)"),
    ({"name": "x", "profile": "tiny"},
     "grid / variants: give one of them (or seeds: alone: the base profile per seed)"),
    ({"name": "x", "profile": "tiny", "seeds": [1, True]},
     "seeds[1]: expected int, got bool True"),
    ({"name": "x", "profile": "tiny", "seeds": [3, 3]}, "variants 1 and 2 are the same (seed=3)"),
    ({"name": "x", "profile": "tiny", "set": {"seed": 4}, "seeds": [1, 2]},
     "seeds / seed: the seed is set in two places; keep it under seeds: only"),
    ({"name": "x", "profile": "tiny", "grid": {"train.warmup_steps": [1, 2, 3]}, "seeds": list(range(22))},
     f"seeds: 66 variants, more than the limit of {MAX_VARIANTS}; split the sweep"),
    ({"name": "x", "profile": "tiny", "seeds": [1, -1]},
     "variant 2: seed: -1 is out of range (expected >= 0) (profile tiny with seed=-1)"),
    ({"name": "x", "profile": "small", "grid": {"train.warmup_steps": [1]}},
     "profile: no such profile 'small' (a file name of profiles/*.yaml without .yaml); known: demo, multi30k, "
     "paper, paper-big, tiny"),
    ({"profile": "tiny", "grid": {"train.warmup_steps": [1]}}, "name: missing"),
    ({"name": "a b", "profile": "tiny", "grid": {"train.warmup_steps": [1]}},
     "name: 'a b' is not a sweep name (letters, digits, - and _, at most 40, starting with a letter or digit)"),
    ({"name": "x", "profile": "tiny", "concurrency": 0, "grid": {"train.warmup_steps": [1]}},
     "concurrency: 0 is out of range (expected >= 1)"),
    ("- just\n- a list\n", "expected a mapping with name, profile and grid, variants or seeds"),
])
def test_a_bad_spec_is_refused_with_the_key_named(tmp_path: Path, spec: dict | str, message: str) -> None:
    assert _refused(tmp_path, spec) == message


def test_a_missing_or_unreadable_spec_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"nope\.yaml: file not found$"):
        load_spec(tmp_path / "nope.yaml", REPO)
    assert _refused(tmp_path, "name: [") == "line 1, column 8: not valid YAML: while parsing a flow node: " \
        "expected the node content, but found '<stream end>'; fix the file there"


def test_a_spec_with_yaml_anchors_is_refused_at_the_anchor(tmp_path: Path) -> None:
    spec = "name: s\nprofile: tiny\ngrid:\n  train.warmup_steps: &w [100, 200]\n  train.max_steps: *w\n"
    assert _refused(tmp_path, spec) == "line 4, column 23: YAML anchors and aliases are not accepted (found &w); " \
        "write the value out in full"


def test_the_overrides_turn_the_checkouts_params_into_the_variants_own_profile(tmp_path: Path) -> None:
    """`dvc exp run --temp` starts from the checkout's params.yaml: a sweep of another profile sets what differs."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(merged_profile("paper", REPO)), encoding="utf-8")
    applied = {"train.warmup_steps": 2}
    params = variant_params(merged_profile("tiny", REPO), applied)
    got = overrides(tmp_path, params, applied)
    assert list(got)[0] == "train.warmup_steps" and got["paths.raw"] == "data/tiny/raw"
    assert {**flatten(merged_profile("paper", REPO)), **got} == flatten(params)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(merged_profile("tiny", REPO)), encoding="utf-8")
    assert overrides(tmp_path, params, applied) == applied  # the checkout holds the profile: the spec's keys alone


def test_shared_stages_are_the_leading_stages_no_varied_key_touches() -> None:
    dvc_yaml = REPO / "dvc.yaml"
    assert shared_stages(dvc_yaml, ["train.warmup_steps"]) == ["download", "clean", "bpe", "encode"]
    assert shared_stages(dvc_yaml, ["bpe.vocab_size"]) == ["download", "clean"]
    assert shared_stages(dvc_yaml, ["evaluate.max_len_b"]) == ["download", "clean", "bpe", "encode"]  # no checkpoint
    assert shared_stages(dvc_yaml, ["download.retries"]) == []
    assert shared_stages(dvc_yaml, []) == ["download", "clean", "bpe", "encode"]


def test_the_shared_stages_run_with_valid_params_when_set_alone_is_not(tmp_path: Path) -> None:
    """`set` shortens training below the profile's warmup, which every variant changes: the base is invalid."""
    spec = load_spec(_write(tmp_path, {"name": "short", "profile": "tiny", "set": {"train.max_steps": 4},
                                       "grid": {"train.warmup_steps": [1, 2]}}), REPO)
    base = merged_profile("tiny", REPO)
    with pytest.raises(ConfigError, match="warmup_steps"):
        params_from_dict(variant_params(base, spec.shared), "set alone")
    params = variant_params(base, spec.variants[0].applied)  # what the sweep's shared experiment runs with
    params_from_dict(params, "shared stages")
    assert params["train"]["max_steps"] == 4 and params["train"]["warmup_steps"] == 1


def test_the_example_specs_are_demo_sweeps_of_four_settings_and_three_seeds() -> None:
    spec = load_spec(REPO / "sweeps" / "demo-warmup.yaml", REPO)
    assert spec.profile == "demo" and len(spec.variants) == 4 and spec.concurrency == 2
    shared = variant_params(merged_profile("demo", REPO), spec.variants[0].applied)  # its 200 steps < warmup
    params_from_dict(shared, "shared stages")
    seeds = load_spec(REPO / "sweeps" / "demo-seeds.yaml", REPO)
    assert seeds.profile == "demo" and [v.applied for v in seeds.variants] == [{"seed": s} for s in (1, 2, 3)]


@pytest.mark.slow
def test_nmt_sweep_refuses_a_bad_spec_in_one_line_before_any_server(tmp_path: Path) -> None:
    path = _write(tmp_path, {"name": "x", "profile": "tiny", "grid": {"train.warmup_steps": []}})
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "sweep", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == \
        f"error: {path}: grid.train.warmup_steps: empty; give at least 1 item(s)"
    assert "prefect" not in done.stderr.lower()  # no temporary server was started


def test_a_grid_value_of_paths_outside_the_project_is_refused_before_any_variant_runs(tmp_path: Path) -> None:
    """The stage's own layout check, for every variant, when the spec is read: `python -m flows.sweep` stops with
    one line before any server, experiment or variant (variant 1 would otherwise run the whole pipeline first)."""
    import os
    import subprocess
    import sys

    outside = tmp_path / "elsewhere"
    spec = _write(tmp_path, {"name": "px", "profile": "tiny", "grid": {"paths.train": ["runs/tiny-px/train",
                                                                                        str(outside)]}})
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run([sys.executable, "-m", "flows.sweep", str(spec), "--repo", str(REPO)], cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr.splitlines()) == (1, [
        f"error: {spec}: variant 2: paths.train: {outside} lies outside {REPO}, the folder of the params file; use a "
        "relative path inside data/, runs/, metrics/, plots/ or reports/ (profile tiny with "
        f'paths.train="{outside}")'])
    assert not outside.exists() and not (REPO / ".dvc" / "tmp" / "sweeps" / "px").exists()


@pytest.mark.parametrize("content", ["{not json", '{"name": "s"}', "[]"])
def test_a_state_file_that_is_not_one_is_refused_in_one_line_naming_it(tmp_path: Path, content: str) -> None:
    spec = load_spec(_write(tmp_path, {"name": "s", "profile": "tiny", "seeds": [1, 2]}), REPO)
    state = sweep_dir(tmp_path, "s") / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(content, encoding="utf-8")
    with pytest.raises(SpecError) as err:
        SweepState.load(tmp_path, spec, "abc")
    message = str(err.value)
    assert message.startswith(f"{spec.source}: {state}: not a sweep state file (") and "\n" not in message, message
    assert message.endswith(f"); give this spec another name, or delete {state.parent} to start it over"), message
    assert state.read_text(encoding="utf-8") == content  # left as it was
