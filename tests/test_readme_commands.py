"""The README's "What to run next" block, as written, on the tiny profile (the demo's role, in seconds).

The block's commands run in order in a shell whose PATH starts with this interpreter's folder (what ``source
.venv/bin/activate`` does), in a copy of the project ``dvc repro`` built (``tiny_built``), with ``demo`` read as
``tiny`` and the copy's tiny profile holding the cheap decoding it was built with. The two that serve until
stopped and the flow run are run by the tests named in :data:`ELSEWHERE`; a README command in neither place fails.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import REPO
from tests.helpers.tinyproject import CHEAP_EVALUATE, built_env, copy_built

#: Command (its first words) -> the test that runs it: servers that run until stopped, a whole flow run.
ELSEWHERE = {"nmt ui": "tests/pipeline/test_cli.py::test_ui_serves_this_checkouts_store_on_loopback",
             "nmt serve": "tests/pipeline/test_register.py::test_served_candidate_answers_invocations",
             "nmt run": "tests/flows/test_flows.py::test_nmt_run_is_the_flow"}
#: What a command's output must hold here (after ``demo`` -> ``tiny``).
EXPECT = {"dvc status": "Data and pipelines are up to date",
          "nmt profile": "* tiny", "dvc metrics show": "test.bleu",
          "dvc params diff": "evaluate.max_len_b"}  # the copy's tiny profile decodes cheaper than the committed one


def next_steps(readme: str) -> list[str]:
    """The commands of the README's bash block that starts with ``source .venv/bin/activate``, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    block = next(b for b in blocks if b.startswith("source .venv/bin/activate"))
    lines = (line.split("  #")[0].strip() for line in block.splitlines()[1:])
    return [line for line in lines if line and not line.startswith("#")]


def test_every_readme_command_is_run_here_or_by_a_named_test() -> None:
    for command in next_steps((REPO / "README.md").read_text(encoding="utf-8")):
        covered = [name for prefix, name in ELSEWHERE.items() if command.startswith(prefix)]
        for name in covered:
            path, func = name.split("::")
            tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
            assert func in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, name


@pytest.mark.slow
def test_the_what_to_run_next_block_works_as_written(tiny_built: Path, tmp_path: Path) -> None:
    repo = copy_built(tiny_built, tmp_path / "project")
    tiny = repo / "profiles" / "tiny.yaml"
    profile = yaml.safe_load(tiny.read_text(encoding="utf-8"))
    profile.setdefault("evaluate", {}).update(CHEAP_EVALUATE)  # what the built project's stages ran with
    tiny.write_text(yaml.safe_dump(profile, sort_keys=False), encoding="utf-8")
    activated = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, **built_env(tiny_built), "PATH": activated}
    shell = {"cwd": repo, "env": env, "capture_output": True, "text": True, "timeout": 300, "check": False}
    assert subprocess.run(["nmt", "profile", "paper"], **shell).returncode == 0  # where `make demo` leaves it
    for command in next_steps((REPO / "README.md").read_text(encoding="utf-8")):
        if any(command.startswith(prefix) for prefix in ELSEWHERE):
            continue
        command = command.replace("demo", "tiny")
        done = subprocess.run(["bash", "-c", command], **shell)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        if expected := next((v for k, v in EXPECT.items() if command == k), None):
            assert expected in done.stdout, f"{command}\n{done.stdout[-2000:]}"
        if command.startswith("echo"):
            assert done.stdout.strip(), command  # a translation, however poor the toy model's
    assert yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8"))["profile"] == "paper"
