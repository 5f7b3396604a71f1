"""Faults outside training, on the real stage CLIs: SIGKILL mid-stage, a full disk, a refused write.

A killed ``clean`` or ``encode`` (the stage process alone, or ``dvc repro`` with its whole process
group) leaves no partial output under the output path, only a temporary sibling that the next run
deletes; the next run, through real ``dvc repro`` in a temporary git + DVC repo, produces files
byte-identical to an uninterrupted run. A write that hits the file size limit (``RLIMIT_FSIZE``,
which fails writes with EFBIG exactly as a full disk fails them with ENOSPC) or a folder the stage
may not write is one line naming the file, exit code 1, and the previous output untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from pipeline.core.owned import atomic_path, remove_stale, write_text
from tests.helpers.privileges import without_dac_override
from tests.helpers.data_faults import multi30k_mirror, write_params, write_raw
from tests.helpers.paths import REPO
from tests.helpers.repoutil import git as _git
from tests.helpers.repoutil import init_git_dvc

STAGES = ("clean", "bpe", "encode")


def sha_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def temps(root: Path) -> list[str]:
    """Every temporary sibling (``.<name>.<pid>.<random>.tmp``) anywhere under ``root``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*.tmp"))


def stale_outputs(folder: Path) -> list[str]:
    """The outputs whose temporary siblings lie directly in ``folder``: ``.clean.123.ab12cd34.tmp`` -> clean."""
    return sorted(p.name.split(".")[1] for p in folder.glob(".*.tmp"))


def fsize_limit(limit: int) -> Callable[[], None]:
    """A ``preexec_fn`` capping the size of any file the child writes (writes past it fail with EFBIG)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def stage_cli(stage: str, cwd: Path, preexec_fn: Callable[[], None] | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"pipeline.{stage}", "--params", "params.yaml"], check=False, cwd=cwd,
                          capture_output=True, text=True, timeout=120, preexec_fn=preexec_fn,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1]


def kill_group_when(proc: subprocess.Popen, ready: Callable[[], bool], log: Path, limit_s: float = 90) -> None:
    """SIGKILL ``proc``'s whole process group as soon as ``ready()``; fail if it ends first."""
    deadline = time.monotonic() + limit_s
    while not ready():
        assert proc.poll() is None, f"finished before it could be killed:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "never reached the point to kill at"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def building(parent: Path, name: str, inner: str, at_least: int) -> Callable[[], bool]:
    """True once a staging folder ``.<name>.*.tmp/<name>`` holds ``at_least`` bytes (or files) under ``inner``."""
    def ready() -> bool:
        for tmp in parent.glob(f".{name}.*.tmp"):
            target = tmp / name / inner
            try:
                if target.is_file() and target.stat().st_size >= at_least:
                    return True
                if target.is_dir() and len(list(target.glob("*.parquet"))) >= at_least:
                    return True
            except OSError:
                continue
        return False
    return ready


# --- SIGKILL mid-stage, then dvc repro -------------------------------------------------------------

@pytest.fixture(scope="module")
def dvc_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git + DVC repo: this checkout's packages, the real clean/bpe/encode stages, tiny params,
    and a 200k-pair raw corpus where download would put it."""
    repo_root = REPO
    repo = tmp_path_factory.mktemp("faults") / "template"
    repo.mkdir()
    init_git_dvc(repo)
    for package in ("pipeline", "model"):  # the stages import model.config (the params' model section)
        shutil.copytree(repo_root / package, repo / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(repo_root / "profiles", repo / "profiles")
    stages = yaml.safe_load((repo_root / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {s: stages[s] for s in STAGES}}, sort_keys=False))
    write_params(repo, repo_root)
    (repo / ".gitignore").write_text("/data/\n/metrics/\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "data stages")
    write_raw(repo / "data/tiny/raw", 200_000)
    return repo


def _dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ""}  # the stages import the repo's own copy of pipeline/
    return subprocess.run(["dvc", *args], check=False, cwd=repo, capture_output=True, text=True, timeout=300, env=env)


def _outputs(repo: Path) -> dict[str, dict[str, str]]:
    return {s: sha_tree(repo / "data/tiny" / ("shards" if s == "encode" else s)) for s in STAGES}


@pytest.mark.slow
def test_sigkill_mid_clean_and_mid_encode_then_dvc_repro_is_byte_identical(dvc_template: Path, tmp_path: Path) -> None:
    reference = shutil.copytree(dvc_template, tmp_path / "reference", symlinks=True)
    done = _dvc(reference, "repro")
    assert done.returncode == 0, done.stderr[-3000:]
    expected = _outputs(reference)
    assert len(expected["encode"]) > 1000  # 1001 shards of 200 rows + manifest: encode takes a while

    repo = shutil.copytree(dvc_template, tmp_path / "repo", symlinks=True)
    data, log = repo / "data/tiny", tmp_path / "stage.log"
    env = {**os.environ, "PYTHONPATH": ""}
    with open(log, "wb") as out:  # 1. the clean stage alone, killed while it writes train.en
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.clean"], cwd=repo, stdout=out, stderr=out, env=env,
                                start_new_session=True)
        kill_group_when(proc, building(data, "clean", "train.en", 1 << 20), log)
    assert not (data / "clean").exists() and not (repo / "metrics/tiny/clean.details.json").exists()
    assert stale_outputs(data) == ["clean"]

    with open(log, "wb") as out:  # 2. dvc repro with its whole group (dvc, the stage, its workers) mid-encode
        proc = subprocess.Popen(["dvc", "repro"], cwd=repo, stdout=out, stderr=out, env=env, start_new_session=True)
        kill_group_when(proc, building(data, "shards", "train", 20), log)
    assert "removed" in log.read_text() and "left behind by an interrupted run" in log.read_text()
    assert not (data / "shards").exists() and not (repo / "metrics/tiny/encode.details.json").exists()
    assert stale_outputs(data) == ["shards"]
    assert _outputs(repo)["clean"] == expected["clean"] and _outputs(repo)["bpe"] == expected["bpe"]

    again = _dvc(repo, "repro")  # 3. the next run cleans up and finishes
    assert again.returncode == 0, again.stderr[-3000:]
    assert "left behind by an interrupted run" in again.stderr + again.stdout
    assert _outputs(repo) == expected
    assert temps(repo / "data") == [] and temps(repo / "metrics") == []
    status = _dvc(repo, "status")
    assert "up to date" in status.stdout, status.stdout


def _staging(folder: Path, name: str, pid: int, marked: bool = True) -> Path:
    """A staging folder for ``name`` as process ``pid`` would have left it (``marked``: with its marker)."""
    staging = folder / f".{name}.{pid}.abcd1234.tmp"
    (staging / name).mkdir(parents=True)
    (staging / name / "part").write_text("partial")
    if marked:
        (staging / ".nmt-temporary").write_text(json.dumps({"owner": f"{socket.gethostname()}/{pid}/",
                                                            "for": name}))
    return staging


def test_only_marked_staging_folders_of_dead_writers_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    zombie = subprocess.Popen(["sleep", "30"])
    zombie.kill()  # killed, not yet reaped: dead too
    time.sleep(0.2)
    live = subprocess.Popen(["sleep", "30"])
    try:
        stale = [_staging(tmp_path, "out", dead.pid), _staging(tmp_path, "out", zombie.pid)]
        kept = [_staging(tmp_path, "out", live.pid), _staging(tmp_path, "other", dead.pid),
                _staging(tmp_path, "out", dead.pid + 100_000, marked=False)]  # no marker: not ours
        for name in (".out.tmp", ".out.backup.tmp"):  # look-alikes of the user's
            (tmp_path / name).write_text("mine\n")
        (tmp_path / ".out.notes.tmp").mkdir()
        (tmp_path / ".out.notes.tmp" / "n.txt").write_text("mine\n")
        write_text(tmp_path / "out", "complete\n")
        assert not any(p.exists() for p in stale)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["out", ".out.tmp", ".out.backup.tmp", ".out.notes.tmp", *(p.name for p in kept)])
        assert (tmp_path / ".out.notes.tmp" / "n.txt").read_text() == "mine\n"
        assert remove_stale(tmp_path, "other") == [kept[1]]
    finally:
        live.kill()
        live.wait()
        zombie.wait()
    with atomic_path(tmp_path / "out") as tmp:  # the live writer has gone now
        assert tmp.parent.name.startswith(f".out.{os.getpid()}.") and tmp.name == "out"
        tmp.write_text("again\n")
    assert not kept[0].exists() and kept[2].exists()


# --- the disk fills up ------------------------------------------------------------------------------

@pytest.fixture
def workspace(tmp_path: Path, repo_root: Path) -> Path:
    """tmp_path with tiny params and a 20k-pair raw corpus (train.en ~0.9 MB)."""
    write_params(tmp_path, repo_root, encode={"shard_rows": 100_000})
    write_raw(tmp_path / "data/tiny/raw", 20_000)
    return tmp_path


def test_clean_hitting_the_file_size_limit_keeps_the_previous_output(workspace: Path) -> None:
    first = stage_cli("clean", workspace)
    assert first.returncode == 0, first.stderr
    clean, metrics = workspace / "data/tiny/clean", workspace / "metrics/tiny/clean.details.json"
    before, metrics_before = sha_tree(clean), metrics.read_bytes()
    write_raw(workspace / "data/tiny/raw", 20_000, seed=1)  # new input: a successful run would change the output
    proc = stage_cli("clean", workspace, fsize_limit(256 << 10))
    assert proc.returncode == 1
    assert last_line(proc) == (
        "error: stage clean: cannot write data/tiny/clean/train.en: file size limit reached (EFBIG); raise the file "
        "size limit (ulimit -f) or the file system's maximum, then rerun the stage (data/tiny/clean: the previous "
        "complete version is kept)")
    assert "Traceback" not in proc.stderr
    assert sha_tree(clean) == before and metrics.read_bytes() == metrics_before
    assert temps(workspace) == []


@pytest.mark.slow
def test_encode_hitting_the_file_size_limit_in_a_worker_writes_nothing(workspace: Path) -> None:
    from pipeline import bpe, clean
    from pipeline.core.config import load_params

    params, data = load_params(workspace / "params.yaml"), workspace / "data/tiny"
    clean.stage(params.clean, raw_dir=data / "raw", clean_dir=data / "clean")
    bpe.stage(params.bpe, clean_dir=data / "clean", bpe_dir=data / "bpe")
    proc = stage_cli("encode", workspace, fsize_limit(64 << 10), env={"NMT_DATA_WORKERS": "2"})
    assert proc.returncode == 1, proc.stderr
    assert last_line(proc) == (
        "error: stage encode: cannot write data/tiny/shards/train/part-00000.parquet: file size limit reached "
        "(EFBIG); raise the file size limit (ulimit -f) or the file system's maximum, then rerun the stage "
        "(data/tiny/shards/train/part-00000.parquet: nothing was written there)")
    assert "Traceback" not in proc.stderr
    assert not (workspace / "data/tiny/shards").exists()
    assert not (workspace / "metrics/tiny/encode.details.json").exists()
    assert temps(workspace) == []
    assert stage_cli("encode", workspace).returncode == 0  # with room to write, the same inputs go through


def test_download_through_a_mirror_hitting_the_file_size_limit(tmp_path: Path, repo_root: Path) -> None:
    write_params(tmp_path, repo_root)
    cache = tmp_path / "cache"
    env = {"NMT_DATA_MIRROR": str(multi30k_mirror(tmp_path / "mirror")), "NMT_DOWNLOAD_CACHE": str(cache)}
    proc = stage_cli("download", tmp_path, fsize_limit(256 << 10), env=env)
    assert proc.returncode == 1, proc.stderr
    assert re.fullmatch(
        rf"error: stage download: cannot write {re.escape(str(cache))}/extract/gunzip/data/task1/raw/"
        r"train\.en: file size limit reached \(EFBIG\); raise the file size limit \(ulimit -f\) or the file "
        r"system's maximum, then rerun the stage", last_line(proc)), last_line(proc)
    assert not (tmp_path / "data/tiny/raw").exists() and temps(tmp_path) == []
    assert list(cache.iterdir()) == []  # the staging folder went with the failure
    ok = stage_cli("download", tmp_path, env=env)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "data/tiny/raw/train.en").read_bytes().count(b"\n") == 29_000


# --- a folder the stage may not write ---------------------------------------------------------------

def test_permission_denied_names_the_folder(tmp_path: Path, repo_root: Path) -> None:
    write_params(tmp_path, repo_root, paths={"clean": "data/locked/clean"})
    write_raw(tmp_path / "data/tiny/raw", 100)
    (tmp_path / "data/locked").mkdir(mode=0o555)
    preexec = without_dac_override if os.geteuid() == 0 else None
    try:
        proc = stage_cli("clean", tmp_path, preexec)
    finally:
        (tmp_path / "data/locked").chmod(0o755)
    if "prctl(PR_CAPBSET_DROP)" in proc.stderr:
        pytest.skip("running as root without CAP_SETPCAP: cannot make a folder unwritable")
    assert proc.returncode == 1, proc.stderr
    assert last_line(proc) == (
        "error: stage clean: cannot write data/locked/clean: permission denied (EACCES); make data/locked writable "
        "by this user, or point paths.* in params.yaml elsewhere, then rerun the stage (data/locked/clean: nothing "
        "was written there)")
    assert list((tmp_path / "data/locked").iterdir()) == []


# --- SIGKILL mid-download and mid-average -----------------------------------------------------------

@pytest.mark.slow
def test_sigkill_mid_download_then_the_rerun_resumes_and_is_byte_identical(tmp_path: Path, repo_root: Path) -> None:
    """Killed while fetching from a (slow) HTTP mirror: no raw output; the rerun deletes the dead run's
    extraction folder and writes what an uninterrupted run writes (resuming a ``.part`` file with a Range
    request after a dropped connection is tests/pipeline/test_download.py's)."""
    from tests.helpers.httpserver import Faults, serve

    mirror = multi30k_mirror(tmp_path / "mirror")
    reference, work = tmp_path / "reference", tmp_path / "work"
    write_params(reference, repo_root)
    done = stage_cli("download", reference, env={"NMT_DATA_MIRROR": str(mirror),
                                                 "NMT_DOWNLOAD_CACHE": str(tmp_path / "reference-cache")})
    assert done.returncode == 0, done.stderr
    expected = sha_tree(reference / "data/tiny/raw")
    write_params(work, repo_root)
    cache, log = tmp_path / "cache", tmp_path / "download.log"
    with serve(mirror, Faults(bytes_per_s=200_000)) as (url, _):
        env = {**os.environ, "PYTHONPATH": str(REPO), "NMT_DATA_MIRROR": url, "NMT_DOWNLOAD_CACHE": str(cache)}
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "pipeline.download", "--params", "params.yaml"], cwd=work,
                                    stdout=out, stderr=out, env=env, start_new_session=True)
            kill_group_when(proc, lambda: any(cache.rglob("*.part")), log)  # a transfer under way
        assert not (work / "data/tiny/raw").exists() and not (work / "metrics/tiny/download.details.json").exists()
        assert [p.name for p in cache.iterdir() if p.name.startswith(".extract.")]  # the dead run's staging
        again = stage_cli("download", work, env={"NMT_DATA_MIRROR": url, "NMT_DOWNLOAD_CACHE": str(cache)})
    assert again.returncode == 0, again.stderr
    assert sha_tree(work / "data/tiny/raw") == expected
    assert [p.name for p in cache.iterdir() if p.name.startswith(".extract.")] == []
    assert list(cache.rglob("*.part")) == [] and temps(work) == []


HOLD_BEFORE_RENAME = """
import pathlib, sys, time
write_bytes = pathlib.Path.write_bytes
def held(self, data):  # a slow disk: the bytes are written, the rename into place has not happened yet
    written = write_bytes(self, data)
    if self.parent.name.startswith(".averaged.pt."):  # the payload in its staging folder
        time.sleep(120)
    return written
pathlib.Path.write_bytes = held
from pipeline.average import main
sys.exit(main(["--params", "params.yaml"]))
"""


@pytest.mark.slow
def test_sigkill_mid_average_leaves_no_model_and_the_rerun_is_byte_identical(audit_world: Path,
                                                                           tmp_path: Path) -> None:
    world = shutil.copytree(audit_world, tmp_path / "world", symlinks=True)
    model_dir = world / "data/model"
    first = stage_cli("average", world)
    assert first.returncode == 0, first.stderr
    expected = sha_tree(model_dir)
    shutil.rmtree(model_dir)
    (world / "data/metrics/average.details.json").unlink()
    log = tmp_path / "average.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", HOLD_BEFORE_RENAME], cwd=world, stdout=out, stderr=out,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
        kill_group_when(proc, lambda: any(p.stat().st_size > 0 for p in world.rglob(".averaged.pt.*.tmp/averaged.pt")),
                        log)
    assert not model_dir.exists() and not (world / "data/metrics/average.details.json").exists()
    assert stale_outputs(model_dir.parent) == ["model"]  # only the dead writer's sibling, never a partial model
    again = stage_cli("average", world)
    assert again.returncode == 0, again.stderr
    assert sha_tree(model_dir) == expected and temps(world) == []
