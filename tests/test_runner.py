"""`nmt run`: one MLflow parent run around a real `dvc repro`, stage runs linked and tagged."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core import stages
from pipeline.core.errors import PipelineError
from pipeline.project.profiles import write_profile
from pipeline.project.runner import run_pipeline
from tests.helpers.repoutil import git, init_git_dvc

REPO = Path(__file__).resolve().parents[1]

# A stage that behaves like ours: runs under the stage wrapper, which opens its child run and writes
# its run id into <stage>.details.json.
STAGE_CODE = (
    "from pipeline.core import tracking; from pipeline.core.stage import run_stage; "
    "from pathlib import Path; import sys\n"
    "def body():\n"
    "    tracking.current().log_metrics({'sentences': 3})\n"
    "    Path('out').mkdir(exist_ok=True); Path('out/x.txt').write_text('x')\n"
    "    if Path('FAIL').exists():\n"
    "        sys.exit(1)\n"
    "    return {'sentences': 3}\n"
    "run_stage('bpe', body, metrics_dir='metrics/tiny')\n"
)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    shutil.copytree(REPO / "profiles", ws / "profiles")
    write_profile("tiny", REPO, ws / "params.yaml")
    (ws / "stage.py").write_text(STAGE_CODE)
    (ws / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"bpe": {
        "cmd": f"{sys.executable} stage.py", "deps": ["stage.py"], "params": ["bpe"],
        "outs": ["out", {"metrics/tiny/bpe.details.json": {"cache": False}}],
        "metrics": [{"metrics/tiny/bpe.json": {"cache": False}}]}}}))
    init_git_dvc(ws)
    git(ws, "commit", "-q", "--allow-empty", "-m", "init")
    return ws


def _runs(uri: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("wmt14-transformer")
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def test_parent_run_links_stage_runs_and_tags_their_lock_md5(workspace: Path, mlflow_sqlite: str) -> None:
    assert run_pipeline(stages=[], root=workspace) == 0
    parent, child = _runs(mlflow_sqlite)
    assert parent.data.tags["pipeline"] == "true" and parent.data.params["train.max_steps"] == "20"
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    lock = yaml.safe_load((workspace / "dvc.lock").read_text())
    assert child.data.tags["dvc_lock_md5"] == stages.lock_md5(lock, "bpe") != ""
    assert parent.data.tags["produced_by.bpe"] == child.info.run_id

    # Second pipeline run: DVC skips the stage, the new parent still points at the run that produced it.
    assert run_pipeline(stages=[], root=workspace) == 0
    runs = _runs(mlflow_sqlite)
    assert len(runs) == 3
    assert runs[2].data.tags["produced_by.bpe"] == child.info.run_id


def test_failing_stage_fails_the_parent_run(workspace: Path, mlflow_sqlite: str) -> None:
    (workspace / "FAIL").write_text("")
    with pytest.raises(PipelineError, match=r"`dvc repro` failed with exit code \d+"):
        run_pipeline(stages=[], root=workspace)
    parent = next(r for r in _runs(mlflow_sqlite) if r.data.tags.get("pipeline") == "true")
    assert parent.info.status == "FAILED"


def test_tracking_off_runs_without_a_store(workspace: Path) -> None:
    assert run_pipeline(stages=["bpe"], root=workspace) == 0
    assert json.loads((workspace / "metrics/tiny/bpe.details.json").read_text())["mlflow_run_id"] is None
    assert json.loads((workspace / "metrics/tiny/bpe.json").read_text()) == {"sentences": 3,
                                                                             "seconds": pytest.approx(0, abs=60)}
    assert not (workspace / ".mlflow").exists()
