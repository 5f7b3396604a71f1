"""A temporary git + DVC project holding this checkout's pipeline, with the tiny profile as params.yaml."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from pipeline.project.profiles import write_profile
from tests.helpers.paths import REPO
from tests.helpers.repoutil import git, init_git_dvc


def code_folders(dvc_yaml: Path) -> list[str]:
    """Top-level folders holding the dependencies dvc.yaml names (templated data paths left out)."""
    stages = yaml.safe_load(dvc_yaml.read_text(encoding="utf-8"))["stages"]
    deps = {dep for stage in stages.values() for dep in stage.get("deps", []) if "${" not in dep}
    return sorted({Path(dep).parts[0] for dep in deps if len(Path(dep).parts) > 1 or (REPO / dep).is_dir()})


def make_tiny_project(dest: Path, *, gitignore: bool = True) -> Path:
    """dvc.yaml, its code folders, profiles/ and (``gitignore``) .gitignore copied to ``dest``, the tiny
    profile written as params.yaml, all committed; returns ``dest``."""
    dest.mkdir(parents=True)
    shutil.copy(REPO / "dvc.yaml", dest / "dvc.yaml")
    if gitignore:
        shutil.copy(REPO / ".gitignore", dest / ".gitignore")
    for folder in {*code_folders(REPO / "dvc.yaml"), "profiles"}:
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    init_git_dvc(dest)  # first: the profile switch takes the workspace lock, which lives in .dvc/tmp
    write_profile("tiny", dest)
    git(dest, "add", "-A")
    git(dest, "commit", "-qm", "tiny project")
    return dest
