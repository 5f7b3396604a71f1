"""No stage or command deletes what it did not create: every ``paths.*`` key and every output option pointed
at a folder holding an unrelated file leaves that file in place (``dvc repro`` in a temporary git repo on
the tiny profile, and ``nmt export`` / ``nmt translate`` on its model)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipeline.core.errors import EXIT_PERMANENT
from tests.helpers.privileges import without_dac_override
from tests.helpers.tinyproject import built_env, copy_built

pytestmark = pytest.mark.slow

#: The folder each stage writes whole, by ``paths.*`` key, and the stage that writes it.
FOLDER_OUTPUTS = {"raw": "download", "clean": "clean", "bpe": "bpe", "shards": "encode", "model": "average",
                  "eval": "evaluate"}
#: Folders stages write files into (metrics, plots, reports): the folder itself is not replaced.
FILE_FOLDERS = ("metrics", "plots", "reports")


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
def test_a_flow_stage_refuses_to_let_dvc_delete_a_folder_it_did_not_write(built: Path, key: str) -> None:
    """DVC deletes a declared output before its stage runs (bare ``dvc repro`` follows that rule,
    docs/orchestration.md); ``nmt run``'s stage command (flows/dvc_task.py) refuses first: the user's folder stays."""
    original = (built / "params.yaml").read_bytes()
    keep = _foreign(built, f"data/mine-{key}" if key in ("raw", "clean", "bpe", "shards") else f"runs/mine-{key}")
    try:
        _set_paths(built, **{key: str(keep.parent.relative_to(built))})
        done = _run(built, sys.executable, "-m", "flows.dvc_task", "repro", FOLDER_OUTPUTS[key])
        assert done.returncode == EXIT_PERMANENT, done.stdout[-2000:] + done.stderr[-2000:]
        assert done.stderr.splitlines()[-1].startswith(
            f"error: stage {FOLDER_OUTPUTS[key]}: {keep.parent.relative_to(built)}: refusing to replace this folder: "
            "it is not an output folder this project wrote (it holds no .nmt-output marker)"), done.stderr[-2000:]
        assert "Running stage" not in done.stdout
        assert keep.read_text(encoding="utf-8") == "mine\n"
        assert sorted(p.name for p in keep.parent.iterdir()) == ["keep.txt"]
    finally:
        (built / "params.yaml").write_bytes(original)


def test_stages_that_write_files_into_a_folder_leave_the_other_files(built: Path) -> None:
    original = (built / "params.yaml").read_bytes()
    keeps = {key: _foreign(built, f"{key}/mine-{key}") for key in FILE_FOLDERS}
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
    assert json.loads((clean / ".nmt-output").read_text(encoding="utf-8"))["role"] == "clean"
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


# --- the edges of the rule (pipeline/core/owned.py) --------------------------------------------------

def _errors(done: subprocess.CompletedProcess) -> list[str]:
    """The ``error:`` lines a command printed (its log lines aside); none when it printed a traceback."""
    return [] if "Traceback" in done.stderr else [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]


def _model(built: Path) -> Path:
    return Path(yaml.safe_load((built / "params.yaml").read_text(encoding="utf-8"))["paths"]["model"]) / "averaged.pt"


def _translate_into(built: Path, target: Path | str, *extra: str) -> tuple[subprocess.CompletedProcess, bytes]:
    """``nmt translate`` of one line into the FIFO ``target`` while ``cat`` reads it; (the run, what cat read)."""
    reader = subprocess.Popen(["cat", str(target)], stdout=subprocess.PIPE)
    try:
        done = _nmt(built, "translate", "--model", str(_model(built)), "--input", "in.en", *extra)
        return done, reader.communicate(timeout=10)[0]
    finally:
        reader.kill()
        reader.wait()


def test_translate_writes_into_a_fifo_a_device_or_dev_stdout_and_never_replaces_them(built: Path) -> None:
    (built / "in.en").write_text("A man.\n", encoding="utf-8")
    assert _nmt(built, "translate", "--model", str(_model(built)), "--input", "in.en", "--output", "out.de"
                ).returncode == 0
    expected = (built / "out.de").read_bytes()
    fifo = built / "out.fifo"
    os.mkfifo(fifo)
    done, got = _translate_into(built, fifo, "--output", str(fifo))
    assert done.returncode == 0 and got == expected, done.stderr[-2000:]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    done, got = _translate_into(built, fifo, "--attention-png", str(fifo))
    assert done.returncode == 0 and got.startswith(b"\x89PNG\r\n"), done.stderr[-2000:]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    done = _nmt(built, "translate", "--model", str(_model(built)), "--input", "in.en", "--output", "/dev/stdout")
    assert done.returncode == 0 and done.stdout == expected.decode(), done.stderr[-2000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="making device nodes (mknod) needs root, as CI has")
def test_translate_writes_into_a_character_device_and_refuses_a_block_device(built: Path) -> None:
    (built / "in.en").write_text("A man.\n", encoding="utf-8")
    nodes = {name: built / name for name in ("null", "full", "disk")}
    os.mknod(nodes["null"], 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(nodes["full"], 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    os.mknod(nodes["disk"], 0o600 | stat.S_IFBLK, os.makedev(7, 200))
    runs = {name: _nmt(built, "translate", "--model", str(_model(built)), "--input", "in.en", "--output", name)
            for name in nodes}
    assert runs["null"].returncode == 0, runs["null"].stderr[-2000:]
    assert runs["full"].returncode == 1 and _errors(runs["full"]) == [
        "error: cannot write full: no space left on the device (ENOSPC); free space on the file system holding . "
        "(df -h .), then run the command again"], runs["full"].stderr
    assert runs["disk"].returncode == 1 and _errors(runs["disk"]) == [
        "error: disk: is a block device, not an output this project wrote; refusing to replace it: choose another "
        "output path"], runs["disk"].stderr
    assert all(stat.S_ISCHR(os.lstat(nodes[n]).st_mode) for n in ("null", "full"))
    assert stat.S_ISBLK(os.lstat(nodes["disk"]).st_mode)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_export_never_replaces_a_folder_holding_files_its_copied_marker_does_not_list(built: Path) -> None:
    assert _nmt(built, "export", "--model", str(_model(built)), "--output", "exports/ct2-copy").returncode == 0
    deploy = built / "exports" / "deploy"
    (deploy / "configs").mkdir(parents=True)
    (deploy / "README").write_text("how we deploy\n", encoding="utf-8")
    (deploy / "configs" / "app.yaml").write_text("port: 80\n", encoding="utf-8")
    shutil.copytree(built / "exports" / "ct2-copy", deploy, dirs_exist_ok=True)  # cp -r ct2/. deploy/
    before = _tree(deploy)
    done = _nmt(built, "export", "--model", str(_model(built)), "--output", "exports/deploy")
    assert done.returncode == 1 and _errors(done) == [
        "error: exports/deploy: refusing to replace this folder: it is not a ctranslate2 export folder this project "
        "wrote (it holds README (and 2 more), which its .nmt-output does not list as written by this project); "
        "move it away or choose another output path"], done.stderr
    assert _tree(deploy) == before


def test_files_that_only_look_like_temporaries_survive_every_writer(built: Path) -> None:
    (built / "in.en").write_text("A man.\n", encoding="utf-8")
    looks = {built / ".out.de.tmp": b"mine\n", built / ".out.de.backup.tmp": b"mine\n",
             built / ".out.de.notes.tmp" / "n.txt": b"mine\n", built / "exports" / ".ct2b.notes.tmp" / "n.txt": b"mine\n",
             built / "data" / "tiny" / ".clean.keep.tmp": b"mine\n",
             built / "data" / "tiny" / ".clean.99999.abcdefgh.tmp" / "clean" / "n.txt": b"mine\n",
             Path(os.environ["NMT_DOWNLOAD_CACHE"]) / "extract-99999-abc" / "n.txt": b"mine\n"}
    for path, data in looks.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    runs = [_nmt(built, "translate", "--model", str(_model(built)), "--input", "in.en", "--output", "out.de"),
            _nmt(built, "export", "--model", str(_model(built)), "--output", "exports/ct2b"),
            _run(built, "dvc", "repro", "--force", "--single-item", "download"),
            _run(built, "dvc", "repro", "--force", "--single-item", "clean")]
    assert [r.returncode for r in runs] == [0] * 4, [r.stderr[-2000:] for r in runs]
    assert {path: path.read_bytes() for path in looks} == looks
    assert not any("left behind" in r.stderr for r in runs)


def test_an_export_never_deletes_its_input_reached_through_a_link_into_the_output(built: Path) -> None:
    assert _nmt(built, "export", "--model", str(_model(built)), "--output", "exports/e").returncode == 0
    shutil.copy(built / _model(built), built / "exports" / "e" / "averaged.pt")
    (built / "exports" / "alias").symlink_to("e")
    before = (built / "exports" / "e" / "averaged.pt").read_bytes()
    done = _nmt(built, "export", "--model", "exports/alias/averaged.pt", "--output", "exports/e")
    assert done.returncode == 1 and _errors(done) == [
        "error: --output exports/e: refusing to write there: exports/e is or holds the input "
        "exports/alias/averaged.pt; name a new folder, e.g. exports/alias-ct2"], done.stderr
    assert (built / "exports" / "e" / "averaged.pt").read_bytes() == before


def test_a_training_folder_of_the_users_is_refused_before_training(built: Path) -> None:
    original = (built / "params.yaml").read_bytes()
    mine = built / "runs" / "mine" / "step-00000005"
    mine.mkdir(parents=True)
    (mine / "results.txt").write_text("r\n", encoding="utf-8")
    try:
        _set_paths(built, train="runs/mine")
        done = _run(built, sys.executable, "-m", "pipeline.launch")
        assert done.returncode == 1 and _errors(done) == [
            "error: stage train: runs/mine: refusing to write in this folder: it holds files but no .nmt-output "
            "marker naming 'train', so this project did not make it; move them away or choose another folder"
        ], done.stderr
        assert sorted(p.name for p in (built / "runs" / "mine").iterdir()) == ["step-00000005"]
        assert (mine / "results.txt").read_text(encoding="utf-8") == "r\n"
    finally:
        (built / "params.yaml").write_bytes(original)


def test_a_command_that_cannot_write_its_output_names_the_option_not_params(built: Path) -> None:
    (built / "in.en").write_text("A man.\n", encoding="utf-8")
    (built / "locked").mkdir(mode=0o555)
    try:
        done = subprocess.run([sys.executable, "-m", "pipeline.cli", "translate", "--model", str(_model(built)),
                               "--input", "in.en", "--output", "locked/out.de"], cwd=built, capture_output=True,
                              text=True, timeout=300, check=False,
                              preexec_fn=without_dac_override if os.geteuid() == 0 else None)
    finally:
        (built / "locked").chmod(0o755)
    if "prctl(PR_CAPBSET_DROP)" in done.stderr:
        pytest.skip("running as root without CAP_SETPCAP: cannot make a folder unwritable")
    assert done.returncode == 1 and _errors(done) == [
        "error: cannot write locked/out.de: permission denied (EACCES); make locked writable by this user, or give "
        "--output a path on a writable disk, then run the command again (locked/out.de: nothing was written there)"
    ], done.stderr
    assert list((built / "locked").iterdir()) == []
