"""The Prefect flow ``wmt14-pipeline`` (docs/orchestration.md): one task per DVC stage, each in its own process group.

Ours around theirs: DVC runs the stages and Prefect the tasks; the flow adds what neither knows (the MLflow parent
run, the profile switch, the report).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict, TypeVar

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment as deployment_ctx
from prefect.runtime import flow_run as flow_run_ctx
from prefect.runtime import task_run as task_run_ctx
from prefect.states import State

from flows import parent_run
from flows.dvc_task import publish_hint, repro_command, select_stages, stage_env, stage_status
from flows.dvc_task import push as push_to_remote
from flows.lifeline import kill_all_groups, run_in_group
from flows.report import AUDIT_ARTIFACT_KEY, StageOutcome, render_report
from flows.preflight import check_params_first, quiet_prefect_tracebacks
from flows.server import ensure_api
from pipeline import tracking
from pipeline.core import env
from pipeline.core.config import PathsConfig, flatten, load_params, section_dict
from pipeline.core.details import EvaluateDetails, RegisterDetails, StageDetails, TrainDetails
from pipeline.core.errors import EXIT_PERMANENT, PipelineError
from pipeline.project import command_line
from pipeline.project.profiles import switch_profile
from pipeline.project.workspace import RUN_REMEDY, exclusive_run

D = TypeVar("D", bound=StageDetails)

FLOW_NAME = "wmt14-pipeline"
ARTIFACT_KEY = "wmt14-pipeline-report"
# Retrying helps where failures are transient: lost nodes or NCCL timeouts (train resumes from its last complete
# checkpoint). Download retries the network itself (pipeline/data/fetch.py): a task retry would multiply its
# attempts. Other stages are deterministic. A stage that exits with EXIT_PERMANENT is never retried.
DEFAULT_RETRIES: dict[str, int] = {"train": 2}
DEFAULT_RETRY_DELAY_S: dict[str, float] = {"train": 300.0}


class RunReport(TypedDict):
    """What a run returns: its stages (:class:`StageOutcome` as dicts), MLflow parent run, commit and report."""

    stages: list[dict[str, str | float]]
    mlflow_run_id: str | None
    git_commit: str
    markdown: str


class StageFailed(PipelineError):
    """A ``dvc repro`` stage exited non-zero (``returncode``) or timed out (``returncode`` None)."""

    def __init__(self, stage: str, how: str, returncode: int | None = None) -> None:
        self.stage, self.returncode = stage, returncode
        super().__init__(f"stage '{stage}' {how}")


@dataclass(frozen=True)
class RunSettings:
    """Per-run settings shared by every stage task."""

    repo: str
    force: bool
    extra_env: dict[str, str]  # only the run's ids (:func:`flows.dvc_task.stage_env`): no secrets become inputs
    grace_s: float


def _retry_wanted(task: object, task_run: object, state: State) -> bool:
    """Prefect's ``retry_condition_fn``: retry unless the stage exited with :data:`EXIT_PERMANENT` (a host name that
    does not resolve, a 404, a checksum mismatch: waiting fixes none of them)."""
    try:
        state.result()
    except StageFailed as exc:
        return exc.returncode != EXIT_PERMANENT
    except Exception:  # noqa: BLE001 - any other failure keeps the task's retry policy
        return True
    return True


def _failure(stage: str, returncode: int, seconds: float, args: list[str], stderr_tail: list[str]) -> StageFailed:
    """The StageFailed for a stage command that exited non-zero: with a permanent failure, one line (the stage's
    own ``error: stage ...`` line); else the command and the tail of its stderr."""
    verdicts = [line.removeprefix("error: ") for line in stderr_tail if line.startswith(f"error: stage {stage}: ")]
    if returncode == EXIT_PERMANENT and verdicts:
        return StageFailed(stage, f"failed (exit {returncode}, not retried): {verdicts[-1]}", returncode)
    tail = "\n".join(stderr_tail) or "(no stderr)"
    return StageFailed(stage, f"failed with exit code {returncode} after {seconds:.1f} s: `{' '.join(args)}`\n"
                              f"last {len(stderr_tail)} lines of stderr:\n{tail}", returncode)


@task(name="dvc-repro", cache_policy=NO_CACHE, task_run_name="dvc repro {stage}", retry_condition_fn=_retry_wanted)
def repro_stage(stage: str, settings: RunSettings) -> StageOutcome:
    """Run ``dvc repro --single-item <stage>`` (:func:`flows.dvc_task.repro_command`); a StageFailed when it fails."""
    logger = get_run_logger()
    args = repro_command(stage, force=settings.force)
    logger.info("%s", " ".join(args))
    result = run_in_group(args, cwd=settings.repo, env=stage_env(settings.extra_env), grace_s=settings.grace_s,
                          logger=logger)
    if result.returncode != 0:
        raise _failure(stage, result.returncode, result.duration_s, args, list(result.stderr_tail))
    status = stage_status(stage, result.stdout_lines)
    logger.info("stage '%s' %s in %.1f s", stage, status, result.duration_s)
    return StageOutcome(stage=stage, status=status, duration_s=round(result.duration_s, 2),
                        attempts=task_run_ctx.run_count or 1)


@task(name="dvc-push", cache_policy=NO_CACHE)
def push_results(repo: str) -> str:
    """Push what the run built and its run cache to the default DVC remote (:func:`flows.dvc_task.push`)."""
    said = push_to_remote(repo)
    get_run_logger().info("%s", said)
    return said


def _details(record: type[D], metrics_dir: Path | None) -> D | None:
    """``record``'s file in ``metrics_dir``; None (a warning) when absent or unreadable."""
    try:
        return record.read(metrics_dir) if metrics_dir else None
    except PipelineError as exc:
        get_run_logger().warning("%s", exc)
        return None


def _finish(root: Path, paths: PathsConfig | None, outcomes: list[StageOutcome], parent: tracking.StageRun,
            git: dict[str, str], failure: BaseException | None) -> str:
    """Record the run's end on the MLflow parent; write and return the report (and the audit) as Prefect artifacts."""
    parent_run.record_end(parent, root, Path(paths.metrics) if paths else None, succeeded=failure is None)
    audit_path = f"{paths.reports}/audit.md" if paths else None
    try:
        audit_md = (root / audit_path).read_text(encoding="utf-8") if audit_path else None
    except (OSError, UnicodeDecodeError):
        audit_md = None
    metrics = root / paths.metrics if paths else None
    evaluate, register, train = (_details(record, metrics) for record in (EvaluateDetails, RegisterDetails,
                                                                           TrainDetails))
    markdown = render_report(
        outcomes, bleu=evaluate, mlflow_run_id=parent.run_id,
        tracking_uri=tracking.tracking_uri(root) if parent.run_id else None, git=git,
        failure=(str(failure) or type(failure).__name__) if failure else None, audit_path=audit_path,
        audit_md=audit_md, register=register, train=train,
        ui_page=tracking.ui_page(parent.run_id, root) if parent.run_id else None)
    artifacts = [(markdown, ARTIFACT_KEY, f"{FLOW_NAME}: stages, BLEU, audit, lineage")]
    if audit_md is not None:
        artifacts.append((audit_md, AUDIT_ARTIFACT_KEY, f"{FLOW_NAME}: the run beside the paper ({audit_path})"))
    for text, key, description in artifacts:
        try:
            create_markdown_artifact(text, key=key, description=description)
        except Exception as exc:  # noqa: BLE001 - the report must not mask the stage's own error
            get_run_logger().warning("could not create the %s artifact: %s", key, exc)
    return markdown


def _run_stages(selected: list[str], settings: RunSettings, *, retries: dict[str, int], delays: dict[str, float],
                timeouts_s: dict[str, float], metrics_dir: Path | None, parent: tracking.StageRun,
                outcomes: list[StageOutcome]) -> None:
    """Run the stage tasks in order, appending each outcome (also of the one that fails) to ``outcomes``."""
    for stage in selected:
        started = time.monotonic()
        timeout = timeouts_s.get(stage) if (timeouts_s.get(stage) or 0) > 0 else None
        runner = repro_stage.with_options(retries=retries.get(stage, 0), retry_delay_seconds=delays.get(stage, 0.0),
                                          timeout_seconds=timeout)
        try:
            outcomes.append(runner(stage, settings))
        except BaseException as exc:
            timed_out = isinstance(exc, TimeoutError)
            failed = timed_out or isinstance(exc, StageFailed)
            status = "timed out" if timed_out else f"failed (exit {exc.returncode})" \
                if isinstance(exc, StageFailed) else "interrupted"
            retried = failed and getattr(exc, "returncode", None) != EXIT_PERMANENT
            outcomes.append(StageOutcome(stage=stage, status=status, duration_s=round(time.monotonic() - started, 2),
                                         attempts=retries.get(stage, 0) + 1 if retried else 1))
            if timed_out:
                raise StageFailed(stage, f"timed out after {timeout:.0f} s (process group killed)") from exc
            raise
        if metrics_dir is not None:
            parent_run.record_stage(parent, Path(settings.repo), metrics_dir, stage)


@flow(name=FLOW_NAME)
def wmt14_pipeline(stages: list[str] | None = None, force: bool = False, profile: str | None = None,
                   repo: str = ".", timeouts_s: dict[str, float] | None = None,
                   retries: dict[str, int] | None = None, retry_delay_s: dict[str, float] | None = None,
                   kill_grace_s: float = 30.0, push: bool = True) -> RunReport:
    """Reproduce the DVC stages in order, one task each, under one MLflow parent run.

    Args:
        stages: stages to run, in pipeline order, each ``--single-item`` (default: every stage of dvc.yaml).
        force: pass ``--force`` (rerun even when DVC finds the stage up to date).
        profile: switch the workspace to this profile first (as ``nmt profile``; it stays switched).
        repo: the project checkout (where dvc.yaml lives).
        timeouts_s: wall-clock limit per stage in seconds (missing: none); the group is killed.
        retries: attempts after a failure per stage (default train 2, others 0); a stage exiting with
            :data:`~pipeline.core.errors.EXIT_PERMANENT` is not retried.
        retry_delay_s: seconds before a retry per stage (default train 300).
        kill_grace_s: seconds between SIGTERM and SIGKILL when a stage's group is ended.
        push: once every stage succeeded, ``dvc push --run-cache`` to the default DVC remote (each stage task
            first restores what that remote holds: ``dvc repro --pull``).

    Raises:
        PipelineError: another run holds this workspace, or an unknown stage (refused before anything is touched).
        StageFailed: a stage failed (after its retries) or timed out.
    """
    root = Path(repo).resolve()
    selected = select_stages(root, stages)
    with exclusive_run(root, f"flow run {flow_run_ctx.id or '?'}"):
        logger = get_run_logger()
        parent_run.end_orphans(root, logger)  # the MLflow runs a killed run left RUNNING
        if profile:
            switch_profile(profile, root, RUN_REMEDY)
            logger.info("params.yaml holds profile %s (as after `nmt profile %s`)", profile, profile)
        report = _pipeline(root, selected, force=force, profile=profile, timeouts_s=timeouts_s, retries=retries,
                           retry_delay_s=retry_delay_s, kill_grace_s=kill_grace_s, push=push)
    if hint := publish_hint(root):
        get_run_logger().info("%s", hint)
    return report


def _pipeline(root: Path, selected: list[str], *, force: bool, profile: str | None,
              timeouts_s: dict[str, float] | None, retries: dict[str, int] | None,
              retry_delay_s: dict[str, float] | None, kill_grace_s: float, push: bool) -> RunReport:
    """The body of :func:`wmt14_pipeline`, run while it holds the workspace (and params.yaml holds ``profile``)."""
    params = load_params(root / "params.yaml") if (root / "params.yaml").is_file() else None
    flat = flatten(section_dict(params)) if params else {}
    profile_name, paths = (params.profile, params.paths) if params else ("custom", None)
    retries = {**DEFAULT_RETRIES, **(retries or {})}
    delays = {**DEFAULT_RETRY_DELAY_S, **(retry_delay_s or {})}
    git = tracking.git_tags(root, temporary_params=bool(profile))
    outcomes: list[StageOutcome] = []
    tags = {**git, "prefect.flow_run_id": str(flow_run_ctx.id or ""),
            "prefect.deployment": str(deployment_ctx.name or ""), "profile": profile_name}
    name = parent_run.run_name(profile_name, git.get("git_commit", ""))
    with parent_run.pipeline_run(name, params=flat, root=root, tags=tags) as parent:
        ids = {"MLFLOW_PARENT_RUN_ID": parent.run_id or "", "NMT_PREFECT_FLOW_RUN_ID": str(flow_run_ctx.id or ""),
               "NMT_PROFILE_RUN": profile or ""}
        settings = RunSettings(repo=str(root), force=force, extra_env=ids, grace_s=kill_grace_s)
        failure: BaseException | None = None
        try:
            _run_stages(selected, settings, retries=retries, delays=delays, timeouts_s=timeouts_s or {},
                        metrics_dir=Path(paths.metrics) if paths else None, parent=parent, outcomes=outcomes)
            if push:
                push_results(str(root))
        except BaseException as exc:  # a stage failed, or SIGTERM/cancellation (TerminationSignal)
            failure = exc
            raise
        finally:
            kill_all_groups(grace_s=kill_grace_s)  # nothing may outlive the flow (cancellation, SIGTERM)
            markdown = _finish(root, paths, outcomes, parent, git, failure)
    return {"stages": [asdict(o) for o in outcomes], "mlflow_run_id": parent.run_id,
            "git_commit": git.get("git_commit", ""), "markdown": markdown}


def build_parser() -> argparse.ArgumentParser:
    """``python -m flows.pipeline``'s parser: ``--stages`` and the options ``nmt run`` shares (command_line.py)."""
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=command_line.DESCRIPTION)
    parser.add_argument("--stages", nargs="*", help="stages to run (default: all, in pipeline order)")
    command_line.add_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.pipeline``: run the flow once (a temporary Prefect server when no API URL is set)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_prefect_tracebacks()
    env.prefer_this_interpreter()  # DVC's `python -m pipeline.<stage>` runs in this environment
    try:
        select_stages(args.repo, args.stages)  # refused before any server, lock or MLflow run
        check_params_first(Path(args.repo), args.profile)
        tracking.require_configured_server()  # an unreachable MLflow server too
        ensure_api("flows.pipeline", argv)
        report = wmt14_pipeline(stages=args.stages, force=args.force, profile=args.profile, repo=args.repo,
                                timeouts_s=dict(args.timeout), retry_delay_s=dict(args.retry_delay),
                                kill_grace_s=args.kill_grace, push=args.push)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # SIGTERM: Prefect records the crash, then ends the process by SIGTERM itself
        print("error: interrupted: the running stage was stopped (a checkpoint being written is discarded); "
              "run the same command again to resume", file=sys.stderr)
        return 130
    print(report["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
