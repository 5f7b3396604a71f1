"""The sweep flow on the toy DVC pipeline (``tests/helpers/toyflow.py``): seconds, not minutes.

What is under test is the flow around the variants: the shared stage built once and restored from the run cache in the
variants, a failing variant reported (by its stage's own error line) while the other finishes, the restart that
reruns only the failed one under the MLflow run of its first try, ``dvc exp show`` in the checkout, and a changed
spec refused against the state file.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows.sweep import wmt14_sweep
from flows.sweep_spec import SpecError
from flows.sweep_work import sweep_dir
from pipeline.core.errors import PipelineError
from tests.helpers.toyflow import MakeRepo

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]


def _stages(marker: Path) -> dict[str, dict]:
    """``prep`` reads only ``download`` params (shared); ``fit`` reads ``train`` and fails for warmup 13 while
    ``marker`` exists, with a stage's one-line error (pipeline/core/console.py); ``toy.py bleu`` writes an
    evaluate.details.json (valid BLEU 25.25, test 27.31)."""
    fail = (f"python -c \"import os, sys, yaml; p = yaml.safe_load(open('params.yaml')); "
            f"bad = p['train']['warmup_steps'] == 13 and os.path.exists('{marker}'); "
            f"bad and print('error: stage fit: warmup 13 diverged', file=sys.stderr); sys.exit(1 if bad else 0)\"")
    return {"prep": {"cmd": "python toy.py write prep.txt", "deps": ["toy.py"], "params": ["download"],
                     "outs": ["prep.txt"]},
            "fit": {"cmd": f"{fail} && python toy.py bleu score.txt", "deps": ["toy.py", "prep.txt"],
                    "params": ["train"], "outs": ["score.txt", "metrics/paper/evaluate.details.json"]}}


def _spec(path: Path, warmups: list[int]) -> Path:
    path.write_text(yaml.safe_dump({"name": "toy", "profile": "paper", "concurrency": 2,
                                    "variants": [{"train.warmup_steps": w} for w in warmups]}), encoding="utf-8")
    return path


def test_a_failed_variant_is_reported_and_only_it_runs_again(make_repo: MakeRepo, tmp_path: Path,
                                                            mlflow_sqlite: str) -> None:
    marker = tmp_path / "broken"
    marker.write_text("")
    repo = make_repo(_stages(marker))
    spec = _spec(tmp_path / "toy.yaml", [10, 13])

    with pytest.raises(PipelineError) as failed:
        wmt14_sweep(spec_path=str(spec), repo=str(repo))
    report = repo / "reports" / "sweeps" / "toy.md"
    assert str(failed.value).startswith("sweep toy: 1 of 2 variants did not finish (toy-2: error: stage fit: warmup "
                                        "13 diverged (`dvc exp run --temp --name toy-2 ")
    assert str(failed.value).endswith(f"); see {report}; run the same command again to retry them (finished "
                                      "variants are not rerun)")
    table = report.read_text(encoding="utf-8")
    assert "| **toy-1** (best) | 10 | 25.25 | 27.31 |" in table and "| toy-2 | 13 | - | - |" in table
    assert ("- toy-2: variant toy-2: error: stage fit: warmup 13 diverged (`dvc exp run --temp --name toy-2 "
            "--set-param train.warmup_steps=13` failed with exit code 255 after ") in table  # the stage's line
    state = json.loads((sweep_dir(repo, "toy") / "state.json").read_text(encoding="utf-8"))
    assert sorted(r["status"] for r in state["variants"].values()) == ["done", "failed"]

    marker.unlink()
    second = wmt14_sweep(spec_path=str(spec), repo=str(repo))
    assert second["ran"] == ["toy-2"] and [r["status"] for r in second["records"]] == ["done", "done"]
    # prep ran once, in the sweep's shared experiment; each variant restored it from the run cache
    assert [r["stages"] for r in second["records"]] == [{"prep": "restored", "fit": "ran"}] * 2
    assert second["best"] == "toy-1"  # equal valid BLEU: the first in spec order
    client = MlflowClient(tracking_uri=mlflow_sqlite)
    children = client.search_runs([client.get_run(second["mlflow_run_id"]).info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{second['mlflow_run_id']}'")
    assert sorted((r.data.tags["sweep.variant"], r.info.status) for r in children) == [
        ("toy-1", "FINISHED"), ("toy-2", "FINISHED")]  # toy-2's rerun continued its failed try's run
    third = wmt14_sweep(spec_path=str(spec), repo=str(repo))
    assert third["ran"] == [] and third["records"] == second["records"]

    shown = subprocess.run(["dvc", "exp", "show", "--json"], cwd=repo, capture_output=True, text=True, check=True)
    names = {rev["name"] for entry in json.loads(shown.stdout) for group in entry.get("experiments") or []
             for rev in group["revs"]}
    assert names == {"toy-1", "toy-2"}
    assert (repo / "params.yaml").read_bytes() == (repo / "profiles" / "paper.yaml").read_bytes()  # untouched

    with pytest.raises(SpecError) as changed:
        wmt14_sweep(spec_path=str(_spec(tmp_path / "toy.yaml", [10, 14])), repo=str(repo))
    state_file = sweep_dir(repo, "toy") / "state.json"
    assert str(changed.value) == (f"{tmp_path / 'toy.yaml'}: sweep 'toy' already ran with another profile or other "
                                  f"variants ({state_file}); give this spec another name, or delete "
                                  f"{state_file.parent} to start it over")


def test_a_failed_variant_is_the_last_line_of_the_sweep_command_without_prefects_tracebacks(
        make_repo: MakeRepo, tmp_path: Path) -> None:
    """`python -m flows.sweep`: Prefect logs a failed task run with its traceback; a variant's failure is a
    PipelineError with a one-line summary, so the output holds no traceback and ends with the sweep's line."""
    import os
    import sys

    from prefect.settings import PREFECT_API_URL

    from tests.helpers.paths import REPO

    marker = tmp_path / "broken"
    marker.write_text("")
    repo = make_repo(_stages(marker))
    spec = _spec(tmp_path / "toy.yaml", [10, 13])
    env = {**os.environ, "PYTHONPATH": str(REPO), "NMT_TRACKING": "off",
           "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    proc = subprocess.run([sys.executable, "-m", "flows.sweep", str(spec), "--repo", str(repo)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    out = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 1, out[-20:]
    assert "Traceback (most recent call last):" not in proc.stdout + proc.stderr, out
    last = out[-1]
    assert last.startswith("error: sweep toy: 1 of 2 variants did not finish (toy-2: error: stage fit: warmup 13 "
                           "diverged (`dvc exp run --temp --name toy-2 "), last
    logged = [line.split(" - ", 1)[-1] for line in out if "variant toy-2 failed: " in line]
    assert len(logged) == 1 and logged[0].startswith(
        "variant toy-2 failed: error: stage fit: warmup 13 diverged (`dvc exp run --temp --name toy-2 "), logged
