"""The Prefect flow ``wmt14-pipeline``: DVC executes, Prefect sequences.

One task per DVC stage, each running ``dvc repro --single-item <stage>`` in its own process group
(:mod:`flows.dvc_task`); DVC alone decides what is stale (``cache_policy=NO_CACHE``). The flow
opens the MLflow parent run (:mod:`flows.parent_run`), hands its id and the Prefect flow-run id to the
stages through the subprocess environment only, tags each stage's child run with its dvc.lock md5 (and
the parent with the md5 of the whole dvc.lock it ended at; after a success it logs the parent's headline
metrics, :func:`flows.report.headline_metrics`), and ends with a markdown report: stage statuses, the
BLEU table, the replication audit (``<paths.reports>/audit.md``, also attached as its own artifact
``wmt14-audit``), the MLflow parent run (with the ``mlflow ui`` command for a local store) and the
registered model version and alias from ``<paths.metrics>/register.details.json``.

``--profile NAME`` writes the profile's params.yaml for the run only and restores the previous bytes
when the run ends, however it ends (:func:`pipeline.project.profiles.profile_run`).

Locally, with no ``PREFECT_API_URL`` set, ``python -m flows.pipeline`` starts a temporary Prefect server
for the run (:mod:`flows.server`; no setup). Stopping the run (Ctrl-C, SIGTERM, SIGKILL, a cancel)
stops the running stage's whole process tree within ``--kill-grace`` seconds (:mod:`flows.lifeline`);
the next run resumes (DVC reruns the stage; training continues from its newest checkpoint)::

    python -m flows.pipeline --profile tiny
    python -m flows.pipeline --stages train average evaluate --timeout train=86400
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment as deployment_ctx
from prefect.runtime import flow_run as flow_run_ctx
from prefect.runtime import task_run as task_run_ctx
from prefect.settings import PREFECT_API_URL

from flows import parent_run
from flows.dvc_task import (ProcessResult, kill_all_groups, publish_hint, repro_command, run_in_group,
                            stage_status)
from flows.report import AUDIT_ARTIFACT_KEY, StageOutcome, headline_metrics, render_report
from flows.server import start_temporary_server
from pipeline.core import env
from pipeline.core import stages as stage_table
from pipeline.core import tracking
from pipeline.core.config import PathsConfig, flatten, load_params, section_dict
from pipeline.core.errors import PipelineError
from pipeline.project.profiles import profile_run, restore_params
from pipeline.project.workspace import exclusive_run

log = logging.getLogger(__name__)

FLOW_NAME = "wmt14-pipeline"
ARTIFACT_KEY = "wmt14-pipeline-report"
# Retrying helps where failures are transient: the network (download) and lost nodes or NCCL
# timeouts (train resumes from its last complete checkpoint). Other stages are deterministic.
DEFAULT_RETRIES: dict[str, int] = {"download": 3, "train": 2}
DEFAULT_RETRY_DELAY_S: dict[str, float] = {"download": 60.0, "train": 300.0}


class StageFailed(PipelineError):
    """A ``dvc repro`` stage exited non-zero or timed out."""

    def __init__(self, stage: str, result: ProcessResult) -> None:
        self.stage, self.returncode = stage, result.returncode
        how = (f"timed out after {result.duration_s:.0f} s (process group killed), exit code {result.returncode}"
               if result.timed_out else f"failed with exit code {result.returncode}")
        tail = "\n".join(result.stderr_tail) or "(no stderr)"
        super().__init__(f"stage '{stage}' {how} after {result.duration_s:.1f} s: `{' '.join(result.args)}`\n"
                         f"last {len(result.stderr_tail)} lines of stderr:\n{tail}")


@dataclass(frozen=True)
class RunSettings:
    """Per-run settings shared by every stage task."""

    repo: str
    force: bool
    extra_env: dict[str, str]  # only the run's ids: the task builds the full env, so no secrets become inputs
    grace_s: float


def dvc_stages(repo: str | Path) -> list[str]:
    """Stage names of ``<repo>/dvc.yaml`` in file order (the project's dvc.yaml lists them upstream first)."""
    path = Path(repo) / "dvc.yaml"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise PipelineError(f"{path}: not found; pass --repo pointing at the project checkout") from None
    stages = data.get("stages") or {}
    if not isinstance(stages, dict) or not stages:
        raise PipelineError(f"{path}: no `stages:` mapping")
    return list(stages)


def _select(requested: list[str] | None, known: list[str], repo: str | Path) -> list[str]:
    if not requested:
        return known
    unknown = [s for s in requested if s not in known]
    if unknown:
        raise PipelineError(f"{Path(repo) / 'dvc.yaml'}: no stage {', '.join(map(repr, unknown))}; "
                            f"known: {', '.join(known)}")
    return [s for s in known if s in requested]  # always in pipeline order


@task(name="dvc-repro", cache_policy=NO_CACHE, task_run_name="dvc repro {stage}")
def repro_stage(stage: str, settings: RunSettings, timeout_s: float | None = None) -> StageOutcome:
    """Run ``dvc repro --single-item <stage>`` (:func:`flows.dvc_task.repro_command`); report ran / skipped /
    restored and its duration.

    Raises:
        StageFailed: non-zero exit or timeout (stage name, exit code and stderr tail in the message).
    """
    logger = get_run_logger()
    args = repro_command(stage, force=settings.force)
    logger.info("%s (timeout %s)", " ".join(args), f"{timeout_s:.0f} s" if timeout_s else "none")
    result = run_in_group(args, cwd=settings.repo, env=_stage_env(settings.extra_env), timeout_s=timeout_s,
                          grace_s=settings.grace_s, logger=logger)
    if result.returncode != 0 or result.timed_out:
        raise StageFailed(stage, result)
    status = stage_status(stage, result.stdout_lines)
    logger.info("stage '%s' %s in %.1f s", stage, status, result.duration_s)
    return StageOutcome(stage=stage, status=status, duration_s=round(result.duration_s, 2),
                        attempts=task_run_ctx.run_count or 1)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _tag_stage(repo: Path, metrics_dir: Path | None, stage: str, parent: tracking.StageRun) -> str | None:
    """Tag ``stage``'s MLflow run (its id from ``<stage>.details.json``) with its dvc.lock md5, and the
    parent with ``produced_by.<stage>`` (also for a stage DVC skipped); return the run id."""
    if metrics_dir is None:
        return None
    lock_path, details = repo / "dvc.lock", repo / stage_table.details_file(metrics_dir, stage)
    if not (tracking.enabled() and lock_path.is_file() and details.is_file()):
        return None
    try:
        run_id = json.loads(details.read_text(encoding="utf-8")).get("mlflow_run_id")
        if not run_id:
            return None
        lock = yaml.safe_load(lock_path.read_text(encoding="utf-8")) or {}
        parent_run.tag_run(run_id, {"dvc_lock_md5": stage_table.lock_md5(lock, stage)}, repo)
        parent.set_tags({f"produced_by.{stage}": run_id})
    except Exception as exc:  # noqa: BLE001 - tracking must never fail the pipeline
        log.warning("could not tag the MLflow run of stage %s: %s", stage, exc)
        return None
    return run_id


def _load_params(repo: Path) -> tuple[dict[str, Any], str, PathsConfig | None]:
    """Flattened params, profile name and output paths; empty when the repo has no params.yaml."""
    path = repo / "params.yaml"
    if not path.is_file():
        return {}, "custom", None
    params = load_params(path)
    return flatten(section_dict(params)), params.profile, params.paths


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _lock_md5(root: Path) -> str:
    """md5 of ``dvc.lock`` as the run left it (empty when there is none)."""
    try:
        return hashlib.md5((root / "dvc.lock").read_bytes()).hexdigest()  # a fingerprint, not security
    except OSError:
        return ""


def _log_headline(root: Path, paths: PathsConfig, parent: tracking.StageRun) -> None:
    """Log the headline metrics on the parent run, read from the stages' details files as the DAG left them
    (so they are there also when DVC skipped every stage)."""
    metrics = headline_metrics(_read_json(root / stage_table.details_file(paths.metrics, "evaluate")),
                               _read_json(root / stage_table.details_file(paths.metrics, "train")))
    try:
        parent.log_metrics(metrics)
    except Exception as exc:  # noqa: BLE001 - tracking must never fail the pipeline
        get_run_logger().warning("could not log the headline metrics on the parent run: %s", exc)


def _finish(root: Path, paths: PathsConfig | None, outcomes: list[StageOutcome], parent: tracking.StageRun,
            git: dict[str, str], failure: BaseException | None) -> str:
    """Tag the parent with the final dvc.lock md5 (and, after a success, log its headline metrics); write the
    report (and the audit) as Prefect artifacts.

    Returns:
        The report markdown (also printed by ``python -m flows.pipeline``).
    """
    logger = get_run_logger()
    lock_md5 = _lock_md5(root)
    if lock_md5:
        try:
            parent.set_tags({"dvc_lock_md5": lock_md5})
        except Exception as exc:  # noqa: BLE001 - tracking must never fail the pipeline
            logger.warning("could not tag the parent run with the dvc.lock md5: %s", exc)
    if failure is None and paths is not None:
        _log_headline(root, paths, parent)
    audit_path = f"{paths.reports}/audit.md" if paths else None
    audit_md = _read_text(root / audit_path) if audit_path else None
    markdown = render_report(
        outcomes, bleu=_read_json(stage_table.details_file(root / paths.metrics, "evaluate")) if paths else {},
        mlflow_run_id=parent.run_id,
        tracking_uri=tracking.tracking_uri(root) if parent.run_id else None, git=git,
        failure=(str(failure) or type(failure).__name__) if failure else None, audit_path=audit_path,
        audit_md=audit_md,
        register=_read_json(stage_table.details_file(root / paths.metrics, "register")) if paths else {},
        ui_page=parent_run.ui_page(parent.run_id, root) if parent.run_id else None)
    artifacts = [(markdown, ARTIFACT_KEY, f"{FLOW_NAME}: stages, BLEU, audit, lineage")]
    if audit_md is not None:
        artifacts.append((audit_md, AUDIT_ARTIFACT_KEY, f"{FLOW_NAME}: the run beside the paper ({audit_path})"))
    for text, key, description in artifacts:
        try:
            create_markdown_artifact(text, key=key, description=description)
        except Exception as exc:  # noqa: BLE001 - the report must not mask the stage's own error
            logger.warning("could not create the %s artifact: %s", key, exc)
    return markdown


def _run_ids(parent_id: str | None, profile: str | None) -> dict[str, str]:
    """The ids (and the profile of a ``--profile`` run) a stage tags its run with; the stage's environment only."""
    ids = {"MLFLOW_PARENT_RUN_ID": parent_id or "", "NMT_PREFECT_FLOW_RUN_ID": str(flow_run_ctx.id or ""),
           "NMT_PROFILE_RUN": profile or ""}
    return {k: v for k, v in ids.items() if v}


def _stage_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("MLFLOW_RUN_ID", "MLFLOW_PARENT_RUN_ID", "NMT_PREFECT_FLOW_RUN_ID", "NMT_PROFILE_RUN"):
        env.pop(name, None)  # a global MLFLOW_RUN_ID would make every stage resume one run
    env.update(extra)
    return env


def _run_stages(selected: list[str], settings: RunSettings, *, retries: dict[str, int], delays: dict[str, float],
                timeouts_s: dict[str, float], metrics_dir: Path | None, parent: tracking.StageRun,
                outcomes: list[StageOutcome]) -> None:
    """Run the stage tasks in order, appending each outcome (also of the one that fails) to ``outcomes``."""
    root = Path(settings.repo)
    for stage in selected:
        started = time.monotonic()
        runner = repro_stage.with_options(retries=retries.get(stage, 0), retry_delay_seconds=delays.get(stage, 0.0))
        try:
            outcome = runner(stage, settings, timeouts_s.get(stage))
        except BaseException as exc:
            failed = exc if isinstance(exc, StageFailed) else None
            outcomes.append(StageOutcome(
                stage=stage, status=f"failed (exit {failed.returncode})" if failed else "interrupted",
                duration_s=round(time.monotonic() - started, 2),
                attempts=retries.get(stage, 0) + 1 if failed else 1))
            raise
        outcomes.append(outcome)
        _tag_stage(root, metrics_dir, stage, parent)


@flow(name=FLOW_NAME)
def wmt14_pipeline(stages: list[str] | None = None, force: bool = False, profile: str | None = None,
                   repo: str = ".", timeouts_s: dict[str, float] | None = None,
                   retries: dict[str, int] | None = None, retry_delay_s: dict[str, float] | None = None,
                   kill_grace_s: float = 30.0) -> dict[str, Any]:
    """Reproduce the DVC stages in order, one task each, under one MLflow parent run.

    Args:
        stages: stage names to run (default: every stage of dvc.yaml), always in pipeline order.
            Each runs with ``--single-item``: upstream stages not listed are not checked.
        force: pass ``--force`` (rerun even when DVC finds the stage up to date).
        profile: run with this profile's params.yaml; the previous params.yaml is restored byte for byte at
            the end, however the run ends (``nmt profile NAME`` is the persistent switch).
        repo: the project checkout (where dvc.yaml lives).
        timeouts_s: wall-clock limit per stage in seconds (missing: none); the group is killed.
        retries: attempts after a failure per stage (default download 3, train 2, others 0).
        retry_delay_s: seconds before a retry per stage (default download 60, train 300).
        kill_grace_s: seconds between SIGTERM and SIGKILL when a stage's group is ended.

    Returns:
        ``{"stages": [StageOutcome as dict], "mlflow_run_id", "git_commit", "markdown"}``.

    Raises:
        PipelineError: another run holds this workspace (:mod:`pipeline.project.workspace`), or bad arguments
            (an unknown stage is refused before the workspace, params.yaml or MLflow are touched).
        StageFailed: a stage failed (after its retries) or timed out.
    """
    root = Path(repo).resolve()
    selected = _select(stages, dvc_stages(root), root)
    with exclusive_run(root, f"flow run {flow_run_ctx.id or '?'}"), contextlib.ExitStack() as profiled:
        logger = get_run_logger()
        restore_params(root, logger)  # a --profile run killed before it could restore params.yaml
        parent_run.end_orphans(root, logger)  # the MLflow runs a killed run left RUNNING
        if profile:
            logger.info("params.yaml holds profile %s for this run; the previous one comes back after", profile)
            profiled.enter_context(profile_run(profile, root, logger))
        report = _pipeline(root, selected, force=force, profile=profile, timeouts_s=timeouts_s, retries=retries,
                           retry_delay_s=retry_delay_s, kill_grace_s=kill_grace_s)
    # A --profile run's dvc.lock belongs to params.yaml as it was during the run, not as restored: no hint then.
    if not profile and (hint := publish_hint(root)):
        get_run_logger().info("%s", hint)
    return report


def _pipeline(root: Path, selected: list[str], *, force: bool, profile: str | None,
              timeouts_s: dict[str, float] | None, retries: dict[str, int] | None,
              retry_delay_s: dict[str, float] | None, kill_grace_s: float) -> dict[str, Any]:
    """The body of :func:`wmt14_pipeline`, run while it holds the workspace (and params.yaml holds ``profile``)."""
    flat, profile_name, paths = _load_params(root)
    retries = {**DEFAULT_RETRIES, **(retries or {})}
    delays = {**DEFAULT_RETRY_DELAY_S, **(retry_delay_s or {})}
    git = tracking.git_tags(root, temporary_params=bool(profile))
    outcomes: list[StageOutcome] = []
    tags = {**git, "prefect.flow_run_id": str(flow_run_ctx.id or ""),
            "prefect.deployment": str(deployment_ctx.name or ""), "profile": profile_name}
    name = parent_run.run_name(profile_name, git.get("git_commit", ""))
    with parent_run.pipeline_run(name, params=flat, root=root, tags=tags) as parent:
        settings = RunSettings(repo=str(root), force=force, extra_env=_run_ids(parent.run_id, profile),
                               grace_s=kill_grace_s)
        failure: BaseException | None = None
        try:
            _run_stages(selected, settings, retries=retries, delays=delays, timeouts_s=timeouts_s or {},
                        metrics_dir=Path(paths.metrics) if paths else None, parent=parent, outcomes=outcomes)
        except BaseException as exc:  # a stage failed, or SIGTERM/cancellation (TerminationSignal)
            failure = exc
            raise
        finally:
            kill_all_groups(grace_s=kill_grace_s)  # nothing may outlive the flow (cancellation, SIGTERM)
            markdown = _finish(root, paths, outcomes, parent, git, failure)
    return {"stages": [asdict(o) for o in outcomes], "mlflow_run_id": parent.run_id,
            "git_commit": git.get("git_commit", ""), "markdown": markdown}


def _parse_timeouts(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        stage, sep, value = item.partition("=")
        try:
            out[stage] = float(value)
        except ValueError:
            sep = ""
        if not sep or not stage:
            raise PipelineError(f"--timeout {item!r}: expected STAGE=SECONDS, e.g. train=86400")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.pipeline``: run the flow once (a temporary Prefect server when no API URL is set)."""
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="*", help="stages to run (default: all, in pipeline order)")
    parser.add_argument("--force", action="store_true", help="rerun even if DVC finds the stages up to date")
    parser.add_argument("--profile", help="run with this profile's params.yaml (tiny, demo, multi30k, paper); the "
                                          "previous params.yaml is restored afterwards")
    parser.add_argument("--repo", default=".", help="project checkout holding dvc.yaml (default: .)")
    parser.add_argument("--timeout", action="append", default=[], metavar="STAGE=SECONDS",
                        help="per-stage wall-clock limit (repeatable)")
    parser.add_argument("--retry-delay", action="append", default=[], metavar="STAGE=SECONDS",
                        help="seconds before retrying a failed stage (repeatable)")
    parser.add_argument("--kill-grace", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env.prefer_this_interpreter()  # DVC's `python -m pipeline.<stage>` runs in this environment
    try:
        timeouts, delays = _parse_timeouts(args.timeout), _parse_timeouts(args.retry_delay)
        _select(args.stages, dvc_stages(args.repo), args.repo)  # refused before any server, lock or MLflow run
        tracking.require_configured_server()  # an unreachable MLflow server too
        if not PREFECT_API_URL.value():  # no server configured: a temporary one, then this command again
            os.environ["PREFECT_API_URL"] = start_temporary_server()
            sys.stdout.flush()
            sys.stderr.flush()
            os.execv(sys.executable, [sys.executable, "-m", "flows.pipeline",
                                      *(sys.argv[1:] if argv is None else argv)])
        report = wmt14_pipeline(stages=args.stages, force=args.force, profile=args.profile, repo=args.repo,
                                timeouts_s=timeouts, retry_delay_s=delays, kill_grace_s=args.kill_grace)
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
