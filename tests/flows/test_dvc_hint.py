"""The flow's stage command (``python -m flows.dvc_task repro STAGE``) runs DVC without its ``git add`` reminder.

Plain ``dvc repro`` ends every stage that rewrote dvc.lock with "To track the changes with git, run: ...
To enable auto staging ..."; the flow's command sets DVC's own quiet switch instead (no output filter),
keeps the lines the flow reads, and fails as ``dvc`` does.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flows.dvc_task import PUBLISH_HINT, publish_hint, repro_command, stage_status
from flows.lifeline import run_in_group
from tests.helpers.repoutil import git
from tests.helpers.toyflow import PIPELINE, MakeRepo

pytestmark = pytest.mark.slow

HINT_WORDS = ("To track the changes with git", "git add", "autostage")


def _printed(repo: Path, args: list[str]) -> tuple[int, list[str], str]:
    result = run_in_group(args, cwd=repo)
    return result.returncode, list(result.stdout_lines), "\n".join((*result.stdout_lines, *result.stderr_tail))


def test_a_stage_run_through_the_flow_command_prints_no_staging_hint(make_repo: MakeRepo) -> None:
    repo = make_repo(PIPELINE)
    code, stdout, text = _printed(repo, ["dvc", "repro", "--single-item", "prep"])
    assert code == 0 and all(word in text for word in HINT_WORDS), text  # what plain DVC prints
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "prep ran")
    assert publish_hint(repo) is None  # dvc.lock committed: nothing to say

    code, stdout, text = _printed(repo, repro_command("build"))
    assert code == 0, text
    assert stage_status("build", stdout) == "ran" and "Updating lock file 'dvc.lock'" in text
    assert not any(word in text for word in HINT_WORDS), text
    assert "build" in (repo / "dvc.lock").read_text(encoding="utf-8")
    assert publish_hint(repo) == PUBLISH_HINT  # the one line the flow prints at the end instead

    code, stdout, text = _printed(repo, repro_command("build"))
    assert code == 0 and stage_status("build", stdout) == "skipped", text
    code, stdout, text = _printed(repo, repro_command("build", force=True))
    assert code == 0 and stage_status("build", stdout) == "ran", text
    assert not any(word in text for word in HINT_WORDS), text


def test_a_failing_or_unknown_stage_fails_with_dvcs_one_line_error(make_repo: MakeRepo) -> None:
    repo = make_repo({"bad": {"cmd": "python toy.py fail"}})
    code, _, text = _printed(repo, repro_command("bad"))
    assert code == 255 and "ERROR: failed to reproduce 'bad': failed to run: python toy.py fail, exited with 7" in text
    assert "Traceback" not in text
    code, _, text = _printed(repo, repro_command("nope"))
    assert code == 255 and "ERROR: Stage 'nope' not found inside 'dvc.yaml' file" in text


def test_publish_hint_outside_a_git_repository_is_none(tmp_path: Path) -> None:
    assert subprocess.run(["git", "rev-parse"], cwd=tmp_path, capture_output=True).returncode != 0
    assert publish_hint(tmp_path) is None


def test_the_flow_command_refuses_an_alias_bomb_in_params_before_dvc_parses_it(make_repo: MakeRepo) -> None:
    """A few hundred bytes of nested anchors: bare ``dvc status`` / ``dvc repro`` expand them until the memory
    runs out (docs/reliability.md); the flow's stage command refuses the file in one line, in the time it takes
    to start, and writes no dvc.lock."""
    repo = make_repo({"params": {"cmd": "python toy.py write out.txt", "params": ["evaluate.alphas"],
                                 "outs": ["out.txt"]}})
    levels = ["[" + ", ".join(["0.6"] * 9) + "]", *(["[" + ", ".join([f"*a{i}"] * 9) + "]" for i in range(8)])]
    bomb = "[" + ", ".join(f"&a{i} {level}" for i, level in enumerate(levels)) + "]"  # 9**9 items expanded
    text = (repo / "params.yaml").read_text(encoding="utf-8")
    lines = text.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("  alphas:"))
    lines[row] = f"  alphas: {bomb}"
    (repo / "params.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = subprocess.run(repro_command("params"), cwd=repo, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (78, "")
    assert result.stderr == (f"ERROR: params.yaml: line {row + 1}, column 12: YAML anchors and aliases are not "
                             "accepted (found &a0); write the value out in full\n")
    assert not (repo / "dvc.lock").exists() and not (repo / "out.txt").exists()
