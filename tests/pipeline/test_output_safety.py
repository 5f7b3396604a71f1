"""No stage or command deletes what it did not create: every ``paths.*`` key and every output option pointed
at a folder holding an unrelated file leaves that file in place (``dvc repro`` in a temporary git repo on
the tiny profile, and ``nmt export`` / ``nmt translate`` on its model)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers.tinyproject import built_env, copy_built

pytestmark = pytest.mark.slow

#: The folder each stage writes whole, by ``paths.*`` key, and the stage that writes it.
FOLDER_OUTPUTS = {"raw": "download", "clean": "clean", "bpe": "bpe", "shards": "encode", "model": "average",
                  "eval": "evaluate"}
#: Folders stages write files into (checkpoints, metrics, plots, reports): the folder itself is not replaced.
FILE_FOLDERS = ("train", "metrics", "plots", "reports")


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=repo, capture_output=True, text=True, timeout=900, check=False)


def _foreign(repo: Path, rel: str) -> Path:
    """A folder of the user's at ``rel`` holding ``keep.txt``; returns the file."""
    (repo / rel).mkdir(parents=True)
    keep = repo / rel / "keep.txt"
    keep.write_text("mine\n", encoding="utf-8")
    return keep


def _set_paths(repo: Path, **paths: str) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8"))
    params["paths"].update(paths)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")


@pytest.fixture(scope="module")
def built(tiny_built: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A copy of the tiny project after a whole ``dvc repro`` (tracking off, data from a local mirror)."""
    repo = copy_built(tiny_built, tmp_path_factory.mktemp("output_safety") / "project")
    env = pytest.MonkeyPatch()
    for name, value in built_env(tiny_built).items():
        env.setenv(name, value)
    yield repo
    env.undo()


@pytest.mark.parametrize("key", sorted(FOLDER_OUTPUTS))
def test_a_stage_refuses_to_replace_a_folder_it_did_not_write(built: Path, key: str) -> None:
    original = (built / "params.yaml").read_bytes()
    keep = _foreign(built, f"data/mine-{key}" if key in ("raw", "clean", "bpe", "shards") else f"runs/mine-{key}")
    try:
        _set_paths(built, **{key: str(keep.parent.relative_to(built))})
        done = _run(built, "dvc", "repro", "--single-item", FOLDER_OUTPUTS[key])
        assert done.returncode != 0, done.stdout[-2000:]
        assert f"{keep.parent.relative_to(built)}: refusing to replace this folder" in done.stderr, done.stderr[-2000:]
        assert keep.read_text(encoding="utf-8") == "mine\n"
        assert sorted(p.name for p in keep.parent.iterdir()) == ["keep.txt"]
    finally:
        (built / "params.yaml").write_bytes(original)


def test_stages_that_write_files_into_a_folder_leave_the_other_files(built: Path) -> None:
    original = (built / "params.yaml").read_bytes()
    keeps = {key: _foreign(built, f"{'runs' if key == 'train' else key}/mine-{key}") for key in FILE_FOLDERS}
    try:
        _set_paths(built, **{key: str(keep.parent.relative_to(built)) for key, keep in keeps.items()})
        done = _run(built, "dvc", "repro")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        for key, keep in keeps.items():
            assert keep.read_text(encoding="utf-8") == "mine\n", key
            assert len(list(keep.parent.iterdir())) > 1, f"paths.{key}: the stage wrote nothing there"
    finally:
        (built / "params.yaml").write_bytes(original)


def test_a_stage_replaces_the_folder_it_wrote(built: Path) -> None:
    """The marker makes the second run's swap legal: a rebuilt clean folder replaces the first one."""
    clean = built / yaml.safe_load((built / "params.yaml").read_text(encoding="utf-8"))["paths"]["clean"]
    assert (clean / ".nmt-output").read_text(encoding="utf-8") == "clean\n"
    done = _run(built, "dvc", "repro", "--force", "--single-item", "clean")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (clean / "train.en").is_file()


def _nmt(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return _run(repo, sys.executable, "-m", "pipeline.cli", *args)


def test_export_never_replaces_a_folder_it_did_not_write(built: Path) -> None:
    model = Path(yaml.safe_load((built / "params.yaml").read_text(encoding="utf-8"))["paths"]["model"])
    keep = _foreign(built, "exports/mine")
    for output, why in ((str(keep.parent), "refusing to replace this folder"), (".", "is the current folder"),
                        (str(model), f"is or holds the input {model / 'averaged.pt'}")):
        done = _nmt(built, "export", "--model", str(model / "averaged.pt"), "--output", output)
        assert done.returncode == 1 and why in done.stderr, (output, done.stderr[-2000:])
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert keep.read_text(encoding="utf-8") == "mine\n" and (built / ".git").is_dir()
    assert (built / model / "averaged.pt").is_file()
    first = _nmt(built, "export", "--model", str(model / "averaged.pt"), "--output", "exports/ct2")
    again = _nmt(built, "export", "--model", str(model / "averaged.pt"), "--output", "exports/ct2")
    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr  # its own export: replaced


def test_translate_output_never_replaces_a_folder(built: Path) -> None:
    model = Path(yaml.safe_load((built / "params.yaml").read_text(encoding="utf-8"))["paths"]["model"])
    keep = _foreign(built, "out/mine")
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "translate", "--model", str(model / "averaged.pt"),
                           "--output", str(keep.parent)], cwd=built, input="A man.\n", capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 1 and "refusing to replace this folder" in done.stderr, done.stderr[-2000:]
    assert keep.read_text(encoding="utf-8") == "mine\n"
