"""DVC's side of a flow: the stages of dvc.yaml, what ``dvc repro`` did with one, and the stage command.

``python -m flows.dvc_task repro STAGE [--force]`` is ``dvc repro --single-item --pull STAGE`` without DVC's reminder
to ``git add dvc.lock`` after every stage, and first refuses to let DVC delete an output this project did not write
(DVC deletes a declared output before its stage runs; bare ``dvc repro`` follows that rule). Ours and not DVC's
CLI: ``dvc repro`` has no switch for that reminder alone (``--quiet`` also hides the ``Running stage`` lines
:func:`stage_status` reads).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from pipeline.core.errors import EXIT_PERMANENT, ConfigError, PipelineError
from pipeline.core.owned import refuse_unvouched
from pipeline.core.yamlfile import load_yaml

PUBLISH_HINT = ("dvc.lock changed: to publish this run, commit it with its params (dvc.lock records its numbers): "
                "git add params.yaml dvc.lock metrics/ plots/ && git commit")
#: The variables through which a flow tells a stage which runs it belongs to (set per command, never globally).
RUN_ID_VARIABLES = ("MLFLOW_RUN_ID", "MLFLOW_PARENT_RUN_ID", "NMT_PREFECT_FLOW_RUN_ID", "NMT_PROFILE_RUN")

# What `dvc repro` prints (dvc/stage/run.py, dvc/stage/cache.py, dvc/stage/__init__.py, DVC 3.67).
_STATUS_PATTERNS: tuple[tuple[str, str], ...] = (
    ("ran", r"Running stage '{stage}'"),
    ("restored", r"Stage '{stage}' is cached - skipping run"),
    ("restored", r"Restored stage '{stage}' from run-cache"),
    ("restored", r"Pulling data for stage: '{stage}'"),  # dvc.lock matches, outputs pulled (dvc repro --pull)
    ("skipped", r"Stage '{stage}' didn't change, skipping"),
)


def stage_status(stage: str, stdout_lines: Sequence[str]) -> str:
    """What ``dvc repro`` did with ``stage`` by its stdout: ``ran``, ``restored``, ``skipped`` or ``unknown``."""
    text = "\n".join(stdout_lines)
    for status, pattern in _STATUS_PATTERNS:
        if re.search(pattern.format(stage=re.escape(stage)), text):
            return status
    return "unknown"


def dvc_stages(repo: str | Path) -> list[str]:
    """Stage names of ``<repo>/dvc.yaml`` in file order, upstream first (a PipelineError without any)."""
    path = Path(repo) / "dvc.yaml"
    try:
        stages = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("stages")
    except FileNotFoundError:
        raise PipelineError(f"{path}: not found; pass --repo pointing at the project checkout") from None
    if not isinstance(stages, dict) or not stages:
        raise PipelineError(f"{path}: no `stages:` mapping")
    return list(stages)


def select_stages(repo: str | Path, requested: Sequence[str] | None) -> list[str]:
    """``requested`` (all when empty) in pipeline order; a PipelineError naming an unknown one and the known."""
    known = dvc_stages(repo)
    unknown = [s for s in requested or [] if s not in known]
    if unknown:
        raise PipelineError(f"{Path(repo) / 'dvc.yaml'}: no stage {', '.join(map(repr, unknown))}; "
                            f"known: {', '.join(known)}")
    return [s for s in known if not requested or s in requested]


def stage_env(ids: Mapping[str, str]) -> dict[str, str]:
    """This environment with the run ids of :data:`RUN_ID_VARIABLES` replaced by ``ids`` (empty ones left out)."""
    env = {k: v for k, v in os.environ.items() if k not in RUN_ID_VARIABLES}
    env.update({k: v for k, v in ids.items() if v})
    return env


def repro_command(stage: str, *, force: bool = False) -> list[str]:
    """The command line of ``dvc repro --single-item STAGE [--force]`` without DVC's ``git add`` reminder."""
    return [sys.executable, "-m", "flows.dvc_task", "repro", stage, *(["--force"] if force else [])]


def _stage_exit_code(exc: BaseException) -> int | None:
    """The exit code of the stage command whose failure ``exc`` reports, from the ``StageCmdFailedError`` in its
    causes (dvc/stage/exceptions.py keeps the code only in its message: ``failed to run: CMD, exited with N``)."""
    from dvc.stage.exceptions import StageCmdFailedError

    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, StageCmdFailedError):
        seen = seen.__cause__
    match = re.search(r", exited with (-?\d+)$", str(seen)) if seen is not None else None
    return int(match.group(1)) if match else None


def check_params(root: str | Path = ".") -> None:
    """Read ``root``'s params.yaml with the project's bounded reader before DVC parses it: DVC (ruamel.yaml)
    expands nested YAML aliases without bound (docs/reliability.md: a few hundred bytes took all the memory a
    `dvc status` was given), where :func:`pipeline.core.yamlfile.load_yaml` refuses the first anchor in one line.

    Raises:
        ConfigError: params.yaml holds an anchor or alias, is too large or is not valid YAML (file and line named).
    """
    with contextlib.suppress(FileNotFoundError):  # no params.yaml: DVC says what that means for the stage
        load_yaml(Path(root) / "params.yaml")


def repro(stage: str, *, force: bool = False, root: str | Path = ".") -> int:
    """Reproduce ``stage`` alone through DVC's API (what ``dvc repro --single-item --pull`` calls: outputs and run
    cache entries the default remote holds, if one is configured, are restored, not rebuilt); 0, or 255 (``dvc``'s
    status) after DVC's one-line ``ERROR:``, or :data:`EXIT_PERMANENT` when the stage exited with it, params.yaml
    is refused by :func:`check_params` or an output is not this project's
    (:func:`pipeline.core.owned.refuse_unvouched`): failures no retry fixes, which the flow does not retry.
    ``SCMContext.quiet`` (dvc/repo/scm_context.py) silences the "git add dvc.lock" reminder, as DVC's experiment
    executor does; the flow says once what to commit (:func:`publish_hint`).
    """
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    from dvc.ui import ui

    ui.enable()
    try:
        check_params(root)
    except ConfigError as exc:
        logging.getLogger("dvc").error("%s", exc)  # as DVC's own errors: "ERROR: ..."
        return EXIT_PERMANENT
    try:
        with Repo(str(root)) as dvc:
            dvc.scm_context.quiet = True
            for out in (out for found in dvc.stage.collect(stage) for out in found.outs):
                refuse_unvouched(Path(os.path.relpath(out.fs_path)))
            dvc.reproduce(stage, single_item=True, force=force, pull=bool(dvc.config["core"].get("remote")))
    except PipelineError as exc:  # an output folder of the user's: one line, not retried
        print(f"error: stage {stage}: {exc}", file=sys.stderr)
        return EXIT_PERMANENT
    except DvcException as exc:
        logging.getLogger("dvc").exception("")  # DVC's handler: one "ERROR: ..." line, as `dvc` prints
        return EXIT_PERMANENT if _stage_exit_code(exc) == EXIT_PERMANENT else 255
    return 0


def push(root: str | Path = ".") -> str:
    """``dvc push --run-cache`` of ``root`` to its default remote (outputs and run cache entries, so another machine's
    ``dvc repro --pull`` restores every stage); what happened, in one line. No default remote: nothing is pushed."""
    from dvc.repo import Repo

    with Repo(str(root)) as dvc:
        remote = dvc.config["core"].get("remote")
        if not remote:
            return "no default DVC remote (dvc remote add -d NAME URL): nothing pushed"
        count = dvc.push(run_cache=True)
    return f"dvc push --run-cache: {count} file(s) and run-cache entries sent to remote {remote!r}"


def publish_hint(repo: str | Path) -> str | None:
    """:data:`PUBLISH_HINT` when git sees ``dvc.lock`` in ``repo`` as new or changed, else None."""
    done = subprocess.run(["git", "status", "--porcelain", "--", "dvc.lock"], cwd=repo, capture_output=True,
                          text=True, check=False)
    return PUBLISH_HINT if done.returncode == 0 and done.stdout.strip() else None


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.dvc_task repro STAGE [--force]``: see :func:`repro`."""
    parser = argparse.ArgumentParser(prog="python -m flows.dvc_task",
                                     description="dvc repro --single-item STAGE, without DVC's git-add reminder")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("repro", help="reproduce one stage of dvc.yaml in the current folder")
    rep.add_argument("stage", help="the dvc.yaml stage")
    rep.add_argument("--force", action="store_true", help="run it even if nothing changed (dvc repro --force)")
    args = parser.parse_args(argv)
    return repro(args.stage, force=args.force)


if __name__ == "__main__":
    sys.exit(main())
