"""Acceptance: two runs of the tiny profile compared through DVC, as in DVC's example-get-started.

A temporary git + DVC project holds this checkout's pipeline and .gitignore: a copy of the one that ``dvc repro``
built (``tiny_built``, tests/conftest.py). Run 1 is that ``dvc repro`` (run again here: nothing changed), published
by committing ``params.yaml dvc.lock metrics/ plots/``; run 2 is ``dvc exp run --set-param``. ``dvc metrics
diff``, ``dvc params diff`` and ``dvc exp show`` must then show both runs' numbers. Both runs decode at most a
few pieces per sentence (evaluate.max_len_a = 0), so evaluate takes seconds; run 2 allows longer outputs, which
changes the scores.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.core import stages
from tests.helpers.repoutil import git
from tests.helpers.tinyproject import CHEAP_EVALUATE, built_env, copy_built

pytestmark = pytest.mark.slow


def _dvc(repo: Path, *args: str, timeout: float = 900) -> str:
    done = subprocess.run(["dvc", *args], cwd=repo, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"dvc {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _read(repo: Path, metrics_dir: str, name: str) -> dict[str, Any]:
    return json.loads((repo / stages.metrics_file(metrics_dir, name)).read_text(encoding="utf-8"))


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _exp_rows(shown: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``dvc exp show --json`` as {row name: its data}: the workspace, the commit (by branch) and each experiment."""
    rows: dict[str, dict[str, Any]] = {}
    for entry in shown:
        rows[entry.get("name") or entry["rev"]] = entry["data"]
        for group in entry.get("experiments") or []:
            for rev in group["revs"]:
                rows[rev["name"]] = rev["data"]
    return rows


def test_two_runs_appear_in_metrics_diff_params_diff_and_exp_show(tiny_built: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    repo = copy_built(tiny_built, tmp_path / "project")
    for name, value in built_env(tiny_built).items():
        monkeypatch.setenv(name, value)
    params = yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8"))
    assert params["evaluate"]["max_len_b"] == CHEAP_EVALUATE["max_len_b"] == 2
    metrics_dir = params["paths"]["metrics"]

    assert "Data and pipelines are up to date" in _dvc(repo, "repro")
    shown = _dvc(repo, "metrics", "show").rstrip("\n").splitlines()
    assert len(shown) == 3 and max(map(len, shown)) <= 120, "\n".join(shown)
    git(repo, "add", "params.yaml", "dvc.lock", "metrics/", "plots/")
    git(repo, "commit", "-qm", "run 1")
    assert git(repo, "status", "--porcelain") == ""  # details.json, data, runs and reports stay ignored
    published = git(repo, "ls-files", "metrics", "plots").splitlines()  # DVC's .gitignore of its cached outputs:
    assert sorted(published) == [f"{metrics_dir}/.gitignore", f"{params['paths']['plots']}/.gitignore"]  # dvc.lock
    assert f"{metrics_dir}/evaluate.json" in (repo / "dvc.lock").read_text(encoding="utf-8")  # records the numbers
    first = {name: _read(repo, metrics_dir, name) for name in ("train", "evaluate")}

    _dvc(repo, "exp", "run", "--name", "longer", "--set-param", "evaluate.max_len_b=6")
    second = {name: _read(repo, metrics_dir, name) for name in ("train", "evaluate")}
    assert second["train"] == first["train"]  # only evaluate (and what follows it) ran again
    changed = {k for k, v in _flat(second["evaluate"]).items() if _flat(first["evaluate"])[k] != v}
    assert changed, "longer outputs should change the scores"

    diff = json.loads(_dvc(repo, "metrics", "diff", "--json"))  # HEAD (run 1) vs workspace (run 2)
    evaluate_diff = diff[f"{metrics_dir}/evaluate.json"]
    assert set(evaluate_diff) == changed and f"{metrics_dir}/train.json" not in diff
    for key in changed:
        assert (evaluate_diff[key]["old"], evaluate_diff[key]["new"]) == (_flat(first["evaluate"])[key],
                                                                         _flat(second["evaluate"])[key])
    params_diff = json.loads(_dvc(repo, "params", "diff", "--json"))["params.yaml"]
    assert set(params_diff) == {"evaluate.max_len_b"} and (params_diff["evaluate.max_len_b"]["old"],
                                                             params_diff["evaluate.max_len_b"]["new"]) == (2, 6)

    rows = _exp_rows(json.loads(_dvc(repo, "exp", "show", "--json")))
    wide = {**os.environ, "COLUMNS": "400"}  # the table's own width, not the terminal's
    table = subprocess.run(["dvc", "exp", "show", "--only-changed", "--drop", ".*/.*"], cwd=repo, env=wide, timeout=300,
                           capture_output=True, text=True, check=True).stdout.rstrip().splitlines()  # the README's
    assert "evaluate.max_len_b" in table[1] and "longer" in "".join(table), "\n".join(table)
    assert max(len(line.rstrip()) for line in table) <= 120, "\n".join(table)
    branch = git(repo, "branch", "--show-current")
    assert {"workspace", branch, "longer"} <= set(rows)
    for row, expected, max_len_b in ((branch, first, 2), ("longer", second, 6)):
        metrics = {Path(path).stem: body["data"] for path, body in rows[row]["metrics"].items()}
        assert metrics == expected, row
        assert rows[row]["params"]["params.yaml"]["data"]["evaluate"]["max_len_b"] == max_len_b


def test_a_run_of_another_profile_leaves_this_ones_stages_built(tiny_built: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny -> demo -> tiny: the switches write params.yaml (and the profile's DVC link record) only; back on tiny,
    `dvc repro` restores from DVC's run cache what demo's run replaced in dvc.lock and runs no stage command, and
    demo's outputs stay as they were, also through DVC's `checkout` and `exp run` on tiny; back on demo, nothing
    runs."""
    from pipeline.project.profiles import write_profile

    repo = copy_built(tiny_built, tmp_path / "project")
    for name, value in built_env(tiny_built).items():
        monkeypatch.setenv(name, value)
    built = (repo / "params.yaml").read_bytes()  # tiny with CHEAP_EVALUATE, as the fixture built it
    write_profile("demo", repo)
    assert "changed" in _dvc(repo, "status", "download")  # demo never ran here
    _dvc(repo, "repro", "download")  # dvc.lock now holds demo's download
    demo_raw = repo / yaml.safe_load((repo / "params.yaml").read_text())["paths"]["raw"]
    before = {p: p.read_bytes() for p in demo_raw.rglob("*") if p.is_file()}
    write_profile("tiny", repo)  # back on tiny (its own DVC link record), with the params the fixture built
    (repo / "params.yaml").write_bytes(built)
    again = _dvc(repo, "repro")
    assert "Running stage" not in again and "is cached - skipping run" in again, again
    assert "Data and pipelines are up to date" in _dvc(repo, "status")
    assert before and {p: p.read_bytes() for p in demo_raw.rglob("*") if p.is_file()} == before
    # DVC's `checkout` (no target) and `exp run` delete the links DVC recorded that dvc.yaml does not name
    # (dvc/repo/checkout.py _remove_unused_links): tiny's record does not name demo's outputs
    _dvc(repo, "checkout")
    _dvc(repo, "exp", "run", "--name", "tiny-longer", "--set-param", "evaluate.max_len_b=3")
    assert {p: p.read_bytes() for p in demo_raw.rglob("*") if p.is_file()} == before
    write_profile("demo", repo)
    assert "Running stage" not in (again := _dvc(repo, "repro", "download")), again
    assert {p: p.read_bytes() for p in demo_raw.rglob("*") if p.is_file()} == before
