"""Audit replay and audit tracking: rescored BLEU, dvc.lock's hypotheses md5, the previous evaluation, MLflow.

The workspace is the tiny run that the ``audit_world`` fixture (tests/conftest.py) builds with the real stages.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import audit
from pipeline.auditing.replay import ITEM_LOCK, ITEM_PREVIOUS, ITEM_RESCORED, dvc_dir_md5
from pipeline.core.config import checkpoint_folder, params_from_dict
from pipeline.evaluate import stage as evaluate_stage
from pipeline.tracking.harness import run_stage
from tests.helpers.paths import REPO

#: What the audit stage needs in dvc.yaml for the replay.
REPLAY_DEPS = ("pipeline/auditing", "pipeline/inference/scoring.py", "${paths.raw}/valid.de", "${paths.raw}/test.de",
               "${paths.eval}")
REPORT = "${paths.reports}/audit.json"


def _copy(world: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    shutil.copytree(world, root)
    (root / "dvc.lock").unlink()  # test_audit's stand-in lock: here DVC writes the real one
    return root


def _audit(root: Path, params_file: str = "params.yaml") -> dict:
    """The audit stage under its wrapper (metrics in ``<root>/metrics``); returns the audit it wrote."""
    params = params_from_dict(yaml.safe_load((root / params_file).read_text()))
    run_stage("audit", lambda: audit.stage(params, params_file=root / params_file, lock_file=root / "dvc.lock",
                                           root=root, md_path=root / "data" / "reports" / "audit.md",
                                           json_path=root / "data" / "reports" / "audit.json"),
              params=params, metrics_dir=root / "data" / "metrics", root=root)
    return json.loads((root / "data" / "reports" / "audit.json").read_text(encoding="utf-8"))


def _replay(report: dict) -> dict[str, dict]:
    return {i["item"]: i for i in report["replay"]["items"]}


def _evaluate(root: Path) -> None:
    params = params_from_dict(yaml.safe_load((root / "params.yaml").read_text()))
    p = params.paths
    run_stage("evaluate", lambda: evaluate_stage(params.evaluate, model_dir=root / p.model, shards_dir=root / p.shards,
                                                 raw_dir=root / p.raw, eval_dir=root / p.eval,
                                                 train_dir=root / checkpoint_folder(params),
                                                 spm_model=root / p.bpe / "spm.model"),
              params=params, metrics_dir=root / p.metrics, root=root)


# --- without DVC ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_reevaluation_is_replayed_exactly(audit_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _copy(audit_world, tmp_path)
    monkeypatch.setenv("NMT_DEVICE", "cpu")
    first = _audit(root)
    items = _replay(first)
    assert items[ITEM_RESCORED]["run"] == "reproduced exactly" and items[ITEM_RESCORED]["verdict"] == "matches"
    assert items[ITEM_LOCK]["run"] == "not measured (no dvc.lock)"
    assert items[ITEM_PREVIOUS]["run"] == "not measured (no previous audit recorded an evaluation)"
    bleu_before = (root / "data" / "metrics" / "evaluate.details.json").read_text()
    _evaluate(root)  # the real stage again, on the same model
    assert (root / "data" / "metrics" / "evaluate.details.json").read_text() != bleu_before  # timings differ...
    second = _audit(root)
    items = _replay(second)
    assert items[ITEM_RESCORED]["run"] == "reproduced exactly"
    assert items[ITEM_PREVIOUS]["run"] == "replayed: identical to the previous evaluation"
    assert second["replay"]["record"]["figures"] == first["replay"]["record"]["figures"]  # ...the figures do not
    md = (root / "data" / "reports" / "audit.md").read_text()
    assert "## Replay" in md and "replayed: identical to the previous evaluation" in md


def test_tampered_hypotheses_differ_and_the_figure_is_named(audit_world: Path, tmp_path: Path) -> None:
    root = _copy(audit_world, tmp_path)
    _audit(root)
    bleu = json.loads((root / "data" / "metrics" / "evaluate.details.json").read_text())
    shutil.copyfile(root / "data" / "raw" / "test.de", root / "data" / "eval" / "test.hyp.de")  # a perfect "translation"
    report = _audit(root)
    items = _replay(report)
    rescored = items[ITEM_RESCORED]
    assert rescored["verdict"] == "deviates" and rescored["run"] == "differs"
    assert rescored["deviation"].startswith(f"differs: test.bleu {bleu['test']['bleu']!r} vs 100.0")
    assert "valid." not in rescored["deviation"]
    previous = items[ITEM_PREVIOUS]
    assert previous["verdict"] == "deviates" and "test.hyp.de sha256 " in previous["deviation"]
    assert f"{ITEM_RESCORED}: differs: test.bleu" in "\n".join(report["warnings"])  # a failed check warns


def test_edited_evaluate_details_and_truncated_hypotheses_are_named(audit_world: Path, tmp_path: Path) -> None:
    root = _copy(audit_world, tmp_path)
    path = root / "data" / "metrics" / "evaluate.details.json"
    bleu = json.loads(path.read_text())
    bleu["valid"]["chrf2"] += 1e-9
    path.write_text(json.dumps(bleu))
    deviation = _replay(_audit(root))[ITEM_RESCORED]["deviation"]
    assert deviation == f"differs: valid.chrf2 {bleu['valid']['chrf2']!r} vs {bleu['valid']['chrf2'] - 1e-9!r}"
    hyp = root / "data" / "eval" / "test.hyp.de"
    hyp.write_text("".join(line + "\n" for line in hyp.read_text().split("\n")[:-2]))  # one line lost
    deviation = _replay(_audit(root))[ITEM_RESCORED]["deviation"]
    assert "test: cannot be rescored: " in deviation and "has 3 lines but the reference" in deviation
    hyp.unlink()
    run = _replay(_audit(root))[ITEM_RESCORED]["run"]
    assert run == f"not measured (missing {root / 'data' / 'eval' / 'test.hyp.de'})"


def test_previous_audit_of_another_model_or_params_is_not_compared(audit_world: Path, tmp_path: Path) -> None:
    root = _copy(audit_world, tmp_path)
    report_path = root / "data" / "reports" / "audit.json"
    _audit(root)
    saved = json.loads(report_path.read_text())
    for key, value, why in (("model_sha256", "0" * 64, "another averaged model"),
                            ("evaluate_params", {"evaluate.alphas": [1.0]}, "other evaluate params"),
                            ("references_sha256", {"test": "x"}, "other references")):
        changed = copy.deepcopy(saved)
        changed["replay"]["record"][key] = value
        report_path.write_text(json.dumps(changed))
        item = _replay(_audit(root))[ITEM_PREVIOUS]
        assert item["run"] == f"not measured (the previous audit recorded {why})", key
    report_path.write_text("{not json")  # the audit's own output: replaced, not fatal
    assert _replay(_audit(root))[ITEM_PREVIOUS]["verdict"] == "not measured"
    assert json.loads(report_path.read_text())["replay"]["record"] == saved["replay"]["record"]


# --- with DVC: `dvc repro -f evaluate`, then the audit stage -------------------------------------

def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def _dvc(repo: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": "", "NMT_DEVICE": "cpu"}  # the stages import the repo's own copy
    done = subprocess.run(["dvc", *args], check=False, cwd=repo, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _audit_stage(stages: dict) -> dict:
    """The audit stage of dvc.yaml, checked to hold what the replay needs."""
    st = copy.deepcopy(stages["audit"])
    assert set(REPLAY_DEPS) <= set(st["deps"]), set(REPLAY_DEPS) - set(st["deps"])
    assert REPORT in st["outs"]  # a cached out: DVC deletes it before the stage runs, the replay reads the cached copy
    return st


@pytest.fixture
def dvc_repo(audit_world: Path, tmp_path: Path) -> Path:
    """The tiny run as a git + DVC repo whose dvc.yaml holds the real evaluate and audit stages."""
    repo = _copy(audit_world, tmp_path)
    (repo / "runs").mkdir()
    shutil.move(repo / "data" / "model", repo / "runs" / "model")  # `model` is the package's folder here
    data = yaml.safe_load((repo / "params.yaml").read_text())
    data["paths"]["model"] = "runs/model"
    (repo / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    for package in ("pipeline", "model", "profiles"):
        shutil.copytree(REPO / package, repo / package, ignore=shutil.ignore_patterns("__pycache__"))
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"evaluate": stages["evaluate"],
                                                              "audit": _audit_stage(stages)}}, sort_keys=False))
    for args in (["init", "-q"], ["config", "user.email", "t@example.com"], ["config", "user.name", "test"]):
        _git(repo, *args)
    _dvc(repo, "init", "-q")
    _git(repo, "add", "pipeline", "model", "profiles", "params.yaml", "dvc.yaml", ".dvc")
    _git(repo, "commit", "-qm", "tiny run")
    return repo


@pytest.mark.slow
def test_dvc_repro_force_evaluate_reproduces_bleu_exactly_and_the_audit_says_so(dvc_repo: Path) -> None:
    report_path, bleu_path = dvc_repo / "data" / "reports" / "audit.json", dvc_repo / "data" / "metrics" / "evaluate.details.json"
    _dvc(dvc_repo, "repro", "audit")
    first = json.loads(report_path.read_text())
    lock = yaml.safe_load((dvc_repo / "dvc.lock").read_text())
    recorded = next(o["md5"] for o in lock["stages"]["evaluate"]["outs"] if o["path"] == "data/eval")
    assert dvc_dir_md5(dvc_repo / "data" / "eval")[0] == recorded  # the directory md5 is DVC's own
    items = _replay(first)
    assert (items[ITEM_RESCORED]["run"], items[ITEM_LOCK]["run"]) == ("reproduced exactly", f"identical (md5 {recorded})")
    assert items[ITEM_PREVIOUS]["verdict"] == "not measured"
    bleu_before = json.loads(bleu_path.read_text())

    assert "Running stage 'evaluate'" in _dvc(dvc_repo, "repro", "-f", "evaluate")
    assert "Running stage 'audit'" in _dvc(dvc_repo, "repro", "audit")
    second = json.loads(report_path.read_text())
    items = _replay(second)
    assert [i["verdict"] for i in items.values()] == ["matches"] * 3, items
    assert items[ITEM_PREVIOUS]["run"] == "replayed: identical to the previous evaluation"
    bleu_after = json.loads(bleu_path.read_text())
    for split in ("valid", "test"):
        assert {k: bleu_after[split][k] for k in second["replay"]["record"]["figures"][split]} == \
            {k: bleu_before[split][k] for k in first["replay"]["record"]["figures"][split]}
    metrics = json.loads((dvc_repo / "data" / "metrics" / "audit.details.json").read_text())
    assert metrics["mlflow_run_id"] is None and metrics["replay_identical"] == 1.0  # tracking is off in tests
    assert not (dvc_repo / "data" / "metrics" / "audit.json").exists()  # no DVC metrics: not a compared stage

    hyp = dvc_repo / "data" / "eval" / "valid.hyp.de"  # tampered after DVC recorded it
    hyp.write_text(hyp.read_text() + "extra\n")
    done = subprocess.run([sys.executable, "-m", "pipeline.audit"], check=False, cwd=dvc_repo, text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": ""}, timeout=300)
    assert done.returncode == 0, done.stderr
    items = _replay(json.loads(report_path.read_text()))
    assert items[ITEM_RESCORED]["deviation"].startswith("differs: valid: cannot be rescored")
    assert items[ITEM_LOCK]["deviation"].startswith(f"differs: data/eval md5 {dvc_dir_md5(dvc_repo / 'data' / 'eval')[0]} vs "
                                                    f"{recorded} in dvc.lock (changed: valid.hyp.de)")
    assert "valid.hyp.de sha256" in items[ITEM_PREVIOUS]["deviation"]


# --- MLflow ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_audit_logs_a_child_run_with_reports_and_counts(audit_world: Path, tmp_path: Path, mlflow_sqlite: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from flows.parent_run import pipeline_run

    root = _copy(audit_world, tmp_path)
    monkeypatch.chdir(tmp_path)
    with pipeline_run("pipeline", params={}, root=root) as parent:
        monkeypatch.setenv("MLFLOW_PARENT_RUN_ID", parent.run_id)
        report = _audit(root)
    metrics = json.loads((root / "data" / "metrics" / "audit.details.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_sqlite)
    run = client.get_run(metrics["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "audit"
    assert run.data.tags["mlflow.parentRunId"] == parent.run_id and run.data.tags["stage"] == "audit"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"audit.md", "audit.json", "audit.details.json"}
    summary = report["summary"]
    paper = summary["paper"]  # the paper's items only; run checks are counted apart
    assert {k: run.data.metrics[k] for k in ("matches", "deviates", "not_measured", "checks_passed")} == \
        {"matches": paper["matches"], "deviates": paper["deviates"], "not_measured": paper["not measured"],
         "checks_passed": summary["checks"]["matches"]}
    bleu = json.loads((root / "data" / "metrics" / "evaluate.details.json").read_text())
    assert run.data.metrics["test_bleu"] == bleu["test"]["bleu"]
    assert run.data.metrics["parameters"] == json.loads((root / "data" / "metrics" / "average.details.json").read_text())["parameters"]
    assert metrics["report_sha256"] == run.data.tags["audit_json_sha256"]

    tracked = (root / "data" / "reports" / "audit.json").read_bytes()  # no run id in the report: same bytes untracked
    shutil.rmtree(root / "data" / "reports")
    monkeypatch.setenv("NMT_TRACKING", "off")
    _audit(root)
    assert (root / "data" / "reports" / "audit.json").read_bytes() == tracked
    assert json.loads((root / "data" / "metrics" / "audit.details.json").read_text())["mlflow_run_id"] is None
