"""The acceptance run: the real ``wmt14-pipeline`` flow, every real stage, the ``tiny`` profile.

A temporary git + DVC repository holds this checkout's dvc.yaml, profiles and the code folders
its stages depend on, with the paper profile as the committed params.yaml; both runs pass
``--profile tiny``, which holds for the run only (the clone stays clean). Data comes from a synthetic
Multi30k-shaped mirror (``tests/helpers/mirror.py``), MLflow writes to a temporary SQLite store and
Prefect is the test harness's temporary API. The flow runs twice: in-process (everything runs),
then as ``python -m flows.pipeline`` (everything is skipped; what it prints is the run's report).
The assertions share those two runs.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.dvc_task import dvc_stages
from flows.pipeline import ARTIFACT_KEY, wmt14_pipeline
from flows.report import AUDIT_ARTIFACT_KEY, HEADLINE_METRICS
from pipeline.core import stages
from pipeline.core.config import flatten
from pipeline.project.profiles import merged_profile, render
from tests.helpers.mirror import write_multi30k_mirror
from tests.helpers.paths import REPO
from tests.helpers.repoutil import git as _git
from tests.helpers.repoutil import init_git_dvc

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny-transformer"  # one registered model per profile: never a version of the paper's


@dataclass(frozen=True)
class TinyRuns:
    """The two flow runs every test here looks at: the first in-process, the second via the CLI."""

    repo: Path
    uri: str
    first: dict[str, Any]
    first_id: str
    second_id: str
    second_stdout: str  # what `python -m flows.pipeline` printed: the run's report
    seconds: tuple[float, float]


def code_folders(dvc_yaml: Path) -> list[str]:
    """Top-level folders holding the dependencies dvc.yaml names (templated data paths left out)."""
    stages = yaml.safe_load(dvc_yaml.read_text(encoding="utf-8"))["stages"]
    deps = {dep for stage in stages.values() for dep in stage.get("deps", []) if "${" not in dep}
    return sorted({Path(dep).parts[0] for dep in deps if len(Path(dep).parts) > 1 or (REPO / dep).is_dir()})


def make_project(dest: Path) -> Path:
    """A git + DVC repository with this checkout's pipeline and the paper profile as params.yaml, committed."""
    dest.mkdir(parents=True)
    shutil.copy(REPO / "dvc.yaml", dest / "dvc.yaml")
    for folder in {*code_folders(REPO / "dvc.yaml"), "profiles"}:
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "profiles" / "paper.yaml", dest / "params.yaml")
    init_git_dvc(dest)
    _git(dest, "add", "-A")
    _git(dest, "commit", "-qm", "tiny project")
    return dest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, prefect_harness: None) -> Iterator[TinyRuns]:
    """The flow run twice on a fresh tiny project, tracked in a temporary MLflow store."""
    tmp = tmp_path_factory.mktemp("flow-tiny")
    repo = make_project(tmp / "project")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NMT_TRACKING", "on")
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("NMT_DATA_MIRROR", str(write_multi30k_mirror(tmp / "mirror")))
        mp.setenv("NMT_DOWNLOAD_CACHE", str(tmp / "download-cache"))
        mp.setenv("NMT_NPROC", "1")
        started = time.monotonic()
        first_state = wmt14_pipeline(repo=str(repo), profile="tiny", return_state=True)
        first = first_state.result()
        middle = time.monotonic()
        stdout = _cli_run(repo)
        seconds = (middle - started, time.monotonic() - middle)
        first_id = str(first_state.state_details.flow_run_id)
        yield TinyRuns(repo=repo, uri=uri, first=first, first_id=first_id, second_id=_other_run_id(repo, first_id),
                       second_stdout=stdout, seconds=seconds)


def _cli_run(repo: Path) -> str:
    """``python -m flows.pipeline --repo REPO`` against the harness's API; its stdout."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "flows.pipeline", "--repo", str(repo), "--profile", "tiny"],
                          cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _other_run_id(repo: Path, first_id: str) -> str:
    """The id of the flow run on ``repo`` that is not ``first_id``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentTaskRunId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(
            is_null_=True)))
    ids = {str(r.id) for r in runs if r.parameters.get("repo") == str(repo)} - {first_id}
    assert len(ids) == 1, ids
    return ids.pop()


def _params(repo: Path) -> dict[str, Any]:
    """The params both runs used (the tiny profile; the clone's committed params.yaml is the paper one)."""
    return merged_profile("tiny", repo)


def _logged_value(text: str) -> Any:
    """A param as MLflow stored it (``str(value)``) back as a Python value; tuples compare as lists."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return list(value) if isinstance(value, tuple) else value


def _artifacts(flow_run_id: str) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {str(a.key): str(a.data) for a in arts}


def test_every_stage_runs_then_every_stage_is_skipped(tiny: TinyRuns) -> None:
    stages = dvc_stages(tiny.repo)
    assert [(s["stage"], s["status"]) for s in tiny.first["stages"]] == [(s, "ran") for s in stages]
    second = [tuple(cell.strip() for cell in line.split("|")[1:3]) for line in tiny.second_stdout.splitlines()
              if line.startswith("| ") and line.split("|")[1].strip() in stages]
    assert second == [(s, "skipped") for s in stages]
    status = subprocess.run(["dvc", "status"], cwd=tiny.repo, capture_output=True, text=True, check=True)
    assert "up to date" in status.stdout
    print(f"\nflow runs: first {tiny.seconds[0]:.0f} s, second {tiny.seconds[1]:.0f} s; per stage: "
          + ", ".join(f"{s['stage']} {s['duration_s']:.1f} s" for s in tiny.first["stages"]))


def test_profile_runs_leave_the_workspace_on_their_profile(tiny: TinyRuns) -> None:
    """As after `nmt profile tiny`: params.yaml is tiny's (the committed one is paper's), nothing else tracked changed."""
    assert _git(tiny.repo, "status", "--porcelain", "--untracked-files=no") == "M params.yaml"
    assert (tiny.repo / "params.yaml").read_text(encoding="utf-8") == render("tiny", tiny.repo)


def test_two_pipeline_runs_have_comparable_headline_metrics(tiny: TinyRuns) -> None:
    """What MLflow's Compare view shows for two parent runs: the same metric keys, numbers on both."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tiny.uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.pipeline = 'true'")
    assert len(runs) == 2
    for run in runs:
        assert set(run.data.metrics) == set(HEADLINE_METRICS), run.data.metrics
        assert all(isinstance(v, float) for v in run.data.metrics.values())
        assert run.data.metrics["gpu_hours"] == 0.0 and run.data.metrics["train_steps"] > 0  # trained on CPU
    assert runs[0].data.metrics == runs[1].data.metrics  # the second run skipped every stage: same outputs


def test_mlflow_parent_per_flow_run_and_one_child_per_stage_that_ran(tiny: TinyRuns) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tiny.uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)
    parents = {r.data.tags.get("prefect.flow_run_id"): r for r in runs if r.data.tags.get("pipeline") == "true"}
    assert set(parents) == {tiny.first_id, tiny.second_id} and len(parents) == 2
    assert parents[tiny.first_id].info.run_id == tiny.first["mlflow_run_id"]
    assert f"`{parents[tiny.second_id].info.run_id}`" in tiny.second_stdout

    repo, metrics_dir = tiny.repo, Path(_params(tiny.repo)["paths"]["metrics"])
    lock = yaml.safe_load((repo / "dvc.lock").read_text(encoding="utf-8"))
    head = _git(repo, "rev-parse", "HEAD")
    # Which stages open a run: those whose details JSON records one.
    recorded = {}
    for stage in dvc_stages(repo):
        path = repo / stages.details_file(metrics_dir, stage)
        run_id = json.loads(path.read_text()).get("mlflow_run_id") if path.is_file() else None
        if run_id:
            recorded[stage] = run_id
    assert set(dvc_stages(repo)) - set(recorded) <= {"audit"}

    for flow_run_id, parent in parents.items():
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        if flow_run_id == tiny.first_id:  # everything ran: one child per stage, the one its metrics name
            assert sorted(r.data.tags["stage"] for r in children) == sorted(recorded)
            assert {r.data.tags["stage"]: r.info.run_id for r in children} == recorded
        else:  # everything skipped: no new child, lineage points at the runs that produced the outputs
            assert children == []
        assert {k[len("produced_by."):]: v for k, v in parent.data.tags.items()
                if k.startswith("produced_by.")} == recorded
        assert parent.data.tags["git_commit"] == head and parent.data.tags["git_dirty"] == "false"
        assert parent.data.tags["dvc_lock_md5"]
        assert parent.data.tags["profile"] == "tiny"
    for child in (r for r in runs if r.data.tags.get("mlflow.parentRunId") == tiny.first["mlflow_run_id"]):
        stage = child.data.tags["stage"]
        assert child.data.tags["dvc_lock_md5"] == stages.lock_md5(lock, stage) != ""
        assert child.data.tags["git_commit"] == head and child.data.tags["git_dirty"] == "false"
        assert child.data.tags["profile"] == "tiny"
        assert child.data.tags["prefect.flow_run_id"] == tiny.first_id
    # Both runs end at the same dvc.lock (the second changed nothing).
    assert len({p.data.tags["dvc_lock_md5"] for p in parents.values()}) == 1

    params = parents[tiny.first_id].data.params
    tiny_values = flatten(merged_profile("tiny", REPO))
    assert set(tiny_values) <= set(params)
    for key, value in tiny_values.items():
        assert _logged_value(params[key]) == value, (key, params[key], value)


def test_registered_candidate_translates_from_a_fresh_process_elsewhere(tiny: TinyRuns, tmp_path: Path) -> None:
    register = json.loads((tiny.repo / _params(tiny.repo)["paths"]["metrics"] / "register.details.json").read_text())
    assert register["alias_moved"] and register["model_name"] == MODEL_NAME
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = (
        "import json, mlflow\n"
        "from mlflow.tracking import MlflowClient\n"
        f"m = mlflow.pyfunc.load_model('models:/{MODEL_NAME}@candidate')\n"
        "out = m.predict(['A small dog runs.', 'The old man sits on the street.', ''])\n"
        f"version = MlflowClient().get_model_version_by_alias('{MODEL_NAME}', 'candidate').version\n"
        "import pipeline\n"
        "print(json.dumps({'out': list(out), 'version': str(version), 'code': pipeline.__file__}))\n"
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": tiny.uri, "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True, check=False,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["version"] == register["model_version"] == register["candidate_version"]
    assert len(answer["out"]) == 3 and all(isinstance(s, str) for s in answer["out"]) and answer["out"][2] == ""
    assert any(answer["out"][:2])
    assert Path(answer["code"]).parts[-3:] == ("code", "pipeline", "__init__.py")  # shipped with the model


def test_audit_names_every_key_the_tiny_profile_changes(tiny: TinyRuns) -> None:
    reports = tiny.repo / _params(tiny.repo)["paths"]["reports"]
    audit_md = (reports / "audit.md").read_text(encoding="utf-8")
    audit = json.loads((reports / "audit.json").read_text(encoding="utf-8"))
    paper, small = flatten(merged_profile("paper", REPO)), flatten(merged_profile("tiny", REPO))
    changed = {key for key, value in small.items() if paper.get(key) != value}
    assert changed and {d["key"] for d in audit["profile_differences"]} == changed
    for key in changed - {"profile"}:
        assert key in audit_md, key
    deviations = "\n".join(audit["deviations"])
    for diff in audit["profile_differences"]:
        if diff["kind"] != "operational":
            assert f"{diff['key']} = " in deviations, diff["key"]


def test_report_and_artifacts_point_at_audit_mlflow_ui_and_registry(tiny: TinyRuns) -> None:
    params = _params(tiny.repo)
    audit_rel = f"{params['paths']['reports']}/audit.md"
    audit_md = (tiny.repo / audit_rel).read_text(encoding="utf-8")
    register = json.loads((tiny.repo / params["paths"]["metrics"] / "register.details.json").read_text())
    for md, flow_run_id in ((tiny.first["markdown"], tiny.first_id), (tiny.second_stdout, tiny.second_id)):
        assert "## BLEU" in md and "| test | bleu |" in md
        assert f"Report: `{audit_rel}`" in md
        first_deviation = next(line for line in audit_md.splitlines() if line.startswith("- "))
        assert first_deviation in md
        assert f".venv/bin/mlflow ui --backend-store-uri {tiny.uri} --host 127.0.0.1" in md
        assert f"`models:/{MODEL_NAME}/{register['model_version']}`" in md
        assert f"`models:/{MODEL_NAME}@candidate`" in md
        artifacts = _artifacts(flow_run_id)
        assert artifacts[ARTIFACT_KEY].strip() in md  # the CLI prints the artifact's markdown
        assert artifacts[AUDIT_ARTIFACT_KEY] == audit_md
