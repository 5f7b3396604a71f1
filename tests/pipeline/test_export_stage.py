"""The optional DVC stage ``export`` (export/dvc.yaml): outside the default ``dvc repro``, downstream of
``average``, writing a CTranslate2 directory that ``nmt translate --engine ctranslate2`` loads; bad input
is one line and leaves nothing behind."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline import export
from pipeline.inference import ct2
from tests.helpers.models import make_averaged
from tests.helpers.paths import REPO
from tests.helpers.repoutil import git
from tests.helpers.tinyproject import make_tiny_project


def _dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["dvc", *args], cwd=repo, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny project with export/ committed and an averaged model where params.yaml's paths.model says."""
    tmp = tmp_path_factory.mktemp("export_stage")
    repo = make_tiny_project(tmp / "project")
    shutil.copytree(REPO / "export", repo / "export")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "the optional export stage")
    model_dir = repo / yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8"))["paths"]["model"]
    model_dir.mkdir(parents=True)
    shutil.copy(make_averaged(tmp / "work", seed=3), model_dir / "averaged.pt")
    return repo


def _stand_ins_for_every_dep(repo: Path) -> None:
    """An empty folder (or, for a name with a suffix, an empty file) wherever a ./dvc.yaml dep is missing."""
    paths = yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8"))["paths"]
    for stage in yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8"))["stages"].values():
        for dep in stage.get("deps", []):
            path = repo / re.sub(r"\$\{paths\.(\w+)\}", lambda m: paths[m[1]], dep)
            if path.exists():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch() if path.suffix else path.mkdir()


@pytest.mark.slow
def test_the_default_repro_leaves_export_out_and_export_follows_average(project: Path) -> None:
    _stand_ins_for_every_dep(project)  # a dry run still hashes each stage's deps
    dry = _dvc(project, "repro", "--dry")
    assert dry.returncode == 0, dry.stderr
    assert "'average'" in dry.stdout and "export" not in dry.stdout
    dag = _dvc(project, "dag", "--dot", "export/dvc.yaml:export")
    assert dag.returncode == 0, dag.stderr
    assert '"average" -> "export/dvc.yaml:export"' in dag.stdout


@pytest.mark.slow
def test_repro_of_the_stage_writes_a_ct2_export_and_locks_it(project: Path) -> None:
    done = _dvc(project, "repro", "--single-item", "export/dvc.yaml:export")
    assert done.returncode == 0, done.stdout + done.stderr
    out = project / "runs" / "tiny" / "model-ct2"
    assert {p.name for p in out.iterdir()} >= {"model.bin", ct2.SPM_NAME, ct2.CONFIG_NAME}
    lock = yaml.safe_load((project / "export" / "dvc.lock").read_text(encoding="utf-8"))["stages"]["export"]
    assert lock["cmd"] == "python -m pipeline.export --quantization int8"
    assert {o["path"] for o in lock["outs"]} == {"runs/tiny/model-ct2"}
    assert "runs/tiny/model" in {d["path"] for d in lock["deps"]}
    saved = json.loads((out / ct2.CONFIG_NAME).read_text(encoding="utf-8"))
    translator = ct2.load(out)
    assert translator.config.to_dict() == saved
    status = _dvc(project, "status", "export/dvc.yaml")
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout + status.stderr


def test_a_missing_model_is_one_line_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copy(REPO / "profiles" / "paper.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    assert export.main([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: stage export: ") and "averaged.pt" in err[0], err
    assert not (tmp_path / "runs").exists()
    with pytest.raises(SystemExit) as exc:
        export.main(["--quantization", "int4"])
    assert exc.value.code == 2
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_the_output_sits_beside_the_model_folder() -> None:
    assert export.output_dir("runs/demo/model") == Path("runs/demo/model-ct2")
    assert export.output_dir("runs/demo/model/") == Path("runs/demo/model-ct2")
