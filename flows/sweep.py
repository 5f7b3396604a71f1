"""The Prefect flow ``wmt14-sweep`` (docs/orchestration.md, "Sweeps"): variants of a base profile run as DVC
experiments (``dvc exp run --temp``, :mod:`flows.sweep_work`), mapped by Prefect, each under its own MLflow run; a
restart skips the finished variants.

Prefect maps the variants rather than DVC's queue (``dvc queue start -j N``) runs them: a queued experiment's
environment is fixed when it is queued (``run_env`` in dvc/repo/experiments/queue/base.py), so its stages could not
name the variant's MLflow run, which opens when the variant starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.runtime import flow_run as flow_run_ctx
from prefect.task_runners import ThreadPoolTaskRunner

from flows import parent_run
from flows.dvc_task import dvc_stages, stage_env, stage_status
from flows.lifeline import kill_all_groups, run_in_group
from flows.preflight import quiet_prefect_tracebacks
from flows.report import OBJECTIVE, best_variant, headline_from, paired_lines, render_sweep, seed_stats
from flows.server import ensure_api
from flows.sweep_spec import SweepSpec, Variant, load_spec, variant_params
from flows.sweep_work import (REPORTS_DIR, SweepState, VariantFailed, VariantRecord, check_applied, exp_ref,
                              exp_run_command, head_commit, overrides, read_at, remove_exp, shared_stages, sweep_dir)
from pipeline import tracking
from pipeline.auditing.paper import paper_row
from pipeline.core import env
from pipeline.core.config import flatten, params_from_dict
from pipeline.core.errors import PipelineError
from pipeline.core.owned import write_text
from pipeline.project.command_line import plain
from pipeline.project.profiles import merged_profile
from pipeline.project.workspace import exclusive_run

FLOW_NAME = "wmt14-sweep"


@dataclass(frozen=True)
class SweepContext:
    """What every task of one sweep shares (ids and paths only: no secrets become task inputs)."""

    root: str
    sweep: str
    profile: str
    commit: str
    parent_run_id: str | None
    flow_run_id: str
    grace_s: float

    def env(self, parent_id: str | None) -> dict[str, str]:
        """The environment of a variant's ``dvc exp run``: its stage runs become children of ``parent_id``."""
        out = stage_env({"NMT_PROFILE_RUN": self.profile, "NMT_PREFECT_FLOW_RUN_ID": self.flow_run_id,
                         "MLFLOW_PARENT_RUN_ID": parent_id or ""})
        out.setdefault("NMT_DOWNLOAD_CACHE", str(Path(self.root) / ".cache" / "downloads"))  # not DVC's temp folder's
        return out


def artifact_key(name: str) -> str:
    """The Prefect artifact key of sweep ``name`` (lowercase letters, digits and dashes)."""
    return "wmt14-sweep-" + re.sub(r"[^a-z0-9-]", "-", name.lower())


@task(name="sweep-shared-stages", cache_policy=NO_CACHE, task_run_name="shared stages {stages}")
def build_shared(stages: list[str], ctx: SweepContext, params: dict[str, Any], applied: dict[str, Any]) -> None:
    """Run ``stages`` (those no variant changes) once, as a throwaway experiment: the variants, started after it,
    find them in the run cache instead of each running them at once."""
    logger, root, name = get_run_logger(), Path(ctx.root), f"{ctx.sweep}-shared"
    remove_exp(root, name, ctx.commit)
    result = run_in_group(exp_run_command(name, overrides(root, params, applied), stages[-1]), cwd=root,
                          env=ctx.env(ctx.parent_run_id), grace_s=ctx.grace_s, logger=logger)
    if result.returncode != 0:
        raise VariantFailed("base", result)
    remove_exp(root, name, ctx.commit)
    logger.info("shared stages: %s", ", ".join(f"{s} {stage_status(s, result.stdout_lines)}" for s in stages))


def _variant_tags(ctx: SweepContext, variant: Variant) -> dict[str, str]:
    tags = {**tracking.git_tags(ctx.root, temporary_params=True), "profile": ctx.profile, "sweep": ctx.sweep,
            "sweep.variant": variant.name, "sweep.label": variant.label(), "dvc_exp": variant.name,
            "prefect.flow_run_id": ctx.flow_run_id}
    tags.update({f"override.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in variant.applied.items()})
    if ctx.parent_run_id:
        tags["mlflow.parentRunId"] = ctx.parent_run_id
    return tags


@task(name="sweep-variant", cache_policy=NO_CACHE, task_run_name="variant {variant.name}")
def run_variant(variant: Variant, ctx: SweepContext, base: dict[str, Any]) -> VariantRecord:
    """One variant: ``dvc exp run --temp`` under its MLflow run; return its state record."""
    logger = get_run_logger()
    started, root = time.monotonic(), Path(ctx.root)
    params = variant_params(base, variant.applied)
    record = sweep_dir(root, ctx.sweep) / variant.name  # what the MLflow run and the table read (DVC's folder goes)
    (record / "metrics").mkdir(parents=True, exist_ok=True)
    write_text(record / "params.yaml", yaml.safe_dump(params, sort_keys=False, allow_unicode=True))
    remove_exp(root, variant.name, ctx.commit)  # an interrupted try's, finished after its record was lost
    earlier = tracking.child_run(ctx.parent_run_id, "sweep.variant", variant.name, root)  # an interrupted try's
    with parent_run.pipeline_run(variant.name, params=flatten(params), root=root, files=record,
                                 tags=_variant_tags(ctx, variant), reopen=earlier) as run:
        command = exp_run_command(variant.name, overrides(root, params, variant.applied))
        result = run_in_group(command, cwd=root, env=ctx.env(run.run_id), grace_s=ctx.grace_s, logger=logger)
        if result.returncode != 0:
            raise VariantFailed(variant.name, result)
        rev = exp_ref(root, variant.name, ctx.commit) or ""
        check_applied(root, rev, params)
        write_text(record / "dvc.lock", read_at(root, rev, "dvc.lock"))
        for stage in ("train", "evaluate"):  # what the headline metrics read, where the experiment has them
            with contextlib.suppress(FileNotFoundError):
                write_text(record / "metrics" / f"{stage}.details.json",
                           read_at(root, rev, f"{params['paths']['metrics']}/{stage}.details.json"))
        metrics = headline_from(record / "metrics")
        run.log_metrics(metrics)
        run.set_tags({"dvc_exp_rev": rev})
    statuses = {s: stage_status(s, result.stdout_lines) for s in dvc_stages(root)}
    logger.info("variant %s: valid BLEU %s, stages %s", variant.name, metrics.get(OBJECTIVE),
                ", ".join(f"{s} {v}" for s, v in statuses.items()))
    return VariantRecord(name=variant.name, index=variant.index, overrides=variant.overrides, status="done",
                         metrics=metrics, mlflow_run_id=run.run_id, exp_rev=rev, stages=statuses,
                         duration_s=round(time.monotonic() - started, 1))


def _run_variants(todo: list[Variant], ctx: SweepContext, base: dict[str, Any], spec: SweepSpec,
                  state: SweepState) -> None:
    """Run ``todo`` at most ``spec.concurrency`` at once, recording each outcome as soon as it is known."""
    logger = get_run_logger()
    with ThreadPoolTaskRunner(max_workers=spec.concurrency) as runner:
        futures = {runner.submit(run_variant, {"variant": v, "ctx": ctx, "base": base}): v for v in todo}
        try:
            for future in as_completed(list(futures)):
                variant = futures[future]
                try:
                    record = future.result()
                except Exception as exc:  # noqa: BLE001 - recorded and reported; the others go on
                    lines = str(exc).splitlines() or [type(exc).__name__]
                    error = exc.summary if isinstance(exc, VariantFailed) else \
                        " ".join(dict.fromkeys([lines[0], lines[-1]]))
                    logger.error("variant %s failed: %s", variant.name,
                                 error.removeprefix(f"variant {variant.name}: "))
                    record = VariantRecord(name=variant.name, index=variant.index, overrides=variant.overrides,
                                           status="failed", error=error)
                state.data.variants[variant.key] = record
                state.save()
        except BaseException:
            kill_all_groups(grace_s=ctx.grace_s)  # Ctrl-C, SIGTERM, cancel: no variant outlives the flow
            raise


def _paired(root: Path, spec: SweepSpec, base: dict[str, Any], records: list[VariantRecord]) -> list[str]:
    """The best two variants by valid BLEU, paired on their test outputs (as the evaluate stage scores)."""
    done = sorted((r for r in records if OBJECTIVE in r.metrics),
                  key=lambda r: -r.metrics[OBJECTIVE])[:2]  # sorted is stable: the first of equals stays first
    texts = []
    for record in done:
        variant = next(v for v in spec.variants if v.name == record.name)
        paths = variant_params(base, variant.applied)["paths"]
        try:
            texts.append([read_at(root, record.exp_rev, f).splitlines()
                          for f in (f"{paths['eval']}/test.hyp.de", f"{paths['raw']}/test.de")])
        except Exception:  # noqa: BLE001 - an experiment removed by hand: no paired test, the table stands
            return []
    if len(texts) < 2 or len({len(t) for pair in texts for t in pair}) > 1:
        return []  # one finished variant, or outputs that do not line up with the references: nothing to pair
    return paired_lines([r.name for r in done], [t[0] for t in texts], texts[0][1])


def _publish(root: Path, spec: SweepSpec, markdown: str, parent: tracking.StageRun,
             records: list[VariantRecord]) -> Path:
    """The table as ``reports/sweeps/<name>.md``, a Prefect artifact and an artifact of the MLflow parent."""
    path = root / REPORTS_DIR / f"{spec.name}.md"
    write_text(path, markdown)  # whole or not at all, and never over a folder or link (pipeline/core/owned.py)
    create_markdown_artifact(markdown, key=artifact_key(spec.name), description=f"{FLOW_NAME}: {spec.name}")
    best = best_variant(records)
    parent.log_artifact(path)
    if best is not None:
        parent.set_tags({"sweep.best": best.name})
        parent.log_metrics({f"best_{k}": v for k, v in best.metrics.items() if k in ("valid_bleu", "test_bleu")})
    for setting, by_metric in seed_stats(spec.keys, records).items():  # the intervals, for MLflow's Compare view
        name = "base" if setting == "(base)" else re.sub(r"[^\w./ -]", "_", setting)  # MLflow's allowed characters
        parent.log_metrics({f"seeds/{name}/{metric}_{part}": value for metric, stat in by_metric.items()
                            for part, value in asdict(stat).items() if part != "n"})
    return path


@flow(name=FLOW_NAME)
def wmt14_sweep(spec_path: str, repo: str = ".", kill_grace_s: float = 30.0) -> dict[str, Any]:
    """Run a sweep's unfinished variants, then write its table; ``kill_grace_s``: seconds from SIGTERM to SIGKILL.

    Raises:
        SpecError: a bad spec, or a state file written for other variants (nothing runs).
        PipelineError: the same sweep is running elsewhere, or some variants failed (after all ran).
    """
    root = Path(repo).resolve()
    spec = load_spec(spec_path, root)
    logger, flow_run_id = get_run_logger(), str(flow_run_ctx.id or "")
    head = head_commit(root)
    if tracking.enabled():
        os.environ.setdefault("MLFLOW_TRACKING_URI", tracking.tracking_uri(root))  # DVC's temporary workspaces log here
    with exclusive_run(root, f"sweep {spec.name}", "wait for it to end or stop it",
                       lock=sweep_dir(root, spec.name) / "sweep.lock"):
        parent_run.end_orphans(root, logger)
        state = SweepState.load(root, spec, head)
        if state.data.commit != head:
            logger.warning("sweep %s started at commit %s; its unfinished variants run HEAD %s",
                           spec.name, state.data.commit[:12], head[:12])
        todo = [v for v in spec.variants if not state.done(v.key)]
        logger.info("sweep %s: %d variants, %d to run, %d at once", spec.name, len(spec.variants), len(todo),
                    spec.concurrency)
        base = merged_profile(spec.profile, root)
        with parent_run.sweep_run(root, spec, state, flow_run_id) as parent:
            shared = shared_stages(root / "dvc.yaml", spec.keys) if todo else []
            ctx = SweepContext(root=str(root), sweep=spec.name, profile=spec.profile, commit=head,
                               parent_run_id=parent.run_id, flow_run_id=flow_run_id, grace_s=kill_grace_s)
            if shared:
                build_shared(shared, ctx, variant_params(base, spec.variants[0].applied), spec.variants[0].applied)
            if todo:
                _run_variants(todo, ctx, base, spec, state)
            records = [state.data.variants.get(v.key) or VariantRecord(name=v.name, index=v.index,
                                                                       overrides=v.overrides, status="not run")
                       for v in spec.variants]
            markdown = render_sweep(spec, records, commit=state.data.commit, ran=len(todo),
                                    mlflow_run_id=parent.run_id, paired=_paired(root, spec, base, records),
                                    ui_page=tracking.ui_page(parent.run_id, root) if parent.run_id else None,
                                    tracking_uri=tracking.tracking_uri(root) if parent.run_id else None,
                                    paper=paper_row(params_from_dict(base)) if base["download"]["dataset"] == "wmt14"
                                    else None)
            report = _publish(root, spec, markdown, parent, records)
            failed = [f"{r.name}: " + (r.error or r.status).removeprefix(f"variant {r.name}: ")
                      for r in records if r.status != "done"]  # each with its one-line cause
            if failed:
                raise PipelineError(f"sweep {spec.name}: {len(failed)} of {len(records)} variants did not finish "
                                    f"({'; '.join(failed)}); see {report}; run the same command again to retry "
                                    "them (finished variants are not rerun)")
    best = best_variant(records)
    return {"records": [r.model_dump(exclude_none=True) for r in records], "ran": [v.name for v in todo],
            "best": best.name if best else None,
            "mlflow_run_id": parent.run_id, "flow_run_id": flow_run_id, "markdown": markdown,
            "report": str(report)}


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.sweep SPEC.yaml``: run the sweep once (a temporary Prefect server when no API URL is set)."""
    parser = argparse.ArgumentParser(prog="python -m flows.sweep", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="the sweep's YAML spec (see sweeps/demo-warmup.yaml)")
    parser.add_argument("--repo", default=".", help="project checkout holding dvc.yaml (default: .)")
    parser.add_argument("--kill-grace", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_prefect_tracebacks()  # a failed variant is one line (its summary), not Prefect's traceback of it
    env.prefer_this_interpreter()  # dvc and DVC's `python -m pipeline.<stage>` run in this environment
    try:
        load_spec(args.spec, args.repo)  # a bad spec is refused before any server, experiment or MLflow run
        ensure_api("flows.sweep", argv)
        result = wmt14_sweep(spec_path=args.spec, repo=args.repo, kill_grace_s=args.kill_grace)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted: the running variants were stopped; run the same command again to go on "
              "(finished variants are not rerun)", file=sys.stderr)
        return 130
    print(result["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
