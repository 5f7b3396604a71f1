"""A temporary git + DVC project holding this checkout's pipeline, with the tiny profile as params.yaml, and
the one such project that ``dvc repro`` has built, shared by the tests that start from a finished run."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import yaml

from pipeline.project.profiles import write_profile
from tests.helpers.mirror import write_multi30k_mirror
from tests.helpers.paths import REPO
from tests.helpers.repoutil import git, init_git_dvc

#: Decoding the built project's evaluate stage does: beam 1, at most two pieces a sentence (seconds).
CHEAP_EVALUATE = {"beam_sizes": [1], "max_len_a": 0.0, "max_len_b": 2}


def code_folders(dvc_yaml: Path) -> list[str]:
    """Top-level folders holding the dependencies dvc.yaml names (templated data paths left out)."""
    stages = yaml.safe_load(dvc_yaml.read_text(encoding="utf-8"))["stages"]
    deps = {dep for stage in stages.values() for dep in stage.get("deps", []) if "${" not in dep}
    return sorted({Path(dep).parts[0] for dep in deps if len(Path(dep).parts) > 1 or (REPO / dep).is_dir()})


def make_tiny_project(dest: Path, *, gitignore: bool = True) -> Path:
    """dvc.yaml, .dvcignore, its code folders, profiles/ and (``gitignore``) .gitignore copied to ``dest``, the tiny
    profile written as params.yaml, all committed; returns ``dest``."""
    dest.mkdir(parents=True)
    shutil.copy(REPO / "dvc.yaml", dest / "dvc.yaml")
    shutil.copy(REPO / ".dvcignore", dest / ".dvcignore")
    if gitignore:
        shutil.copy(REPO / ".gitignore", dest / ".gitignore")
    for folder in {*code_folders(REPO / "dvc.yaml"), "profiles"}:
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    init_git_dvc(dest)  # first: the profile switch takes the workspace lock, which lives in .dvc/tmp
    write_profile("tiny", dest)
    git(dest, "add", "-A")
    git(dest, "commit", "-qm", "tiny project")
    return dest


def built_env(root: Path) -> dict[str, str]:
    """The environment the built project's stages ran in (tracking off, one process, the mirror under ``root``);
    a test that runs stages in a copy sets it too."""
    return {"NMT_TRACKING": "off", "NMT_NPROC": "1", "NMT_DATA_MIRROR": str(root / "mirror"),
            "NMT_DOWNLOAD_CACHE": str(root / "download-cache")}


def build_tiny_project(root: Path) -> Path:
    """The tiny project at ``root/project`` with :data:`CHEAP_EVALUATE` in params.yaml (not committed), after a
    whole ``dvc repro`` in :func:`built_env`; returns ``root``."""
    repo = make_tiny_project(root / "project")
    write_multi30k_mirror(root / "mirror")
    params = yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8"))
    params["evaluate"].update(CHEAP_EVALUATE)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    done = subprocess.run(["dvc", "repro"], cwd=repo, env={**os.environ, **built_env(root)}, capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root


def built_once(root: Path) -> Path:
    """:func:`build_tiny_project` at ``root``, once for every pytest process that shares ``root`` (xdist's workers
    share their session's base folder): the first to come builds it, the others wait for it under a file lock."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "BUILT").is_file():
            shutil.rmtree(root, ignore_errors=True)  # what a failed build left
            build_tiny_project(root)
            (root / "BUILT").touch()
    return root


def copy_built(root: Path, dest: Path) -> Path:
    """A copy of the built project (``root/project``) at ``dest``, for a test that changes it; returns ``dest``."""
    return Path(shutil.copytree(root / "project", dest, symlinks=True))

