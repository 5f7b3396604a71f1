"""Stage ``audit``: this run beside the paper's base model, item by item, with its lineage.

Writes ``<paths.reports>/audit.md`` (for people) and ``audit.json`` (the same content, sorted keys,
no timestamps beyond those in the inputs). audit.md opens with a summary that fits one screen
(:mod:`pipeline.auditing.summary`): the test BLEU beside the reference that fits the test set (the paper's 27.3
on WMT14 newstest2014; none on Multi30k, where no comparable published figure exists), the counts, the
warnings, and the deviations, one line per topic ranked by expected effect on BLEU
(:mod:`pipeline.auditing.ranking`); each deviation appears once, the detail tables after it hold the rest.
Items are of three kinds, counted apart: the paper's (they cite it), the reference implementations' (where
the paper is silent) and run checks (averaging, replay, lineage). Every item gets a verdict: ``matches``,
``deviates`` (the deviation named, e.g. ``model.pre_norm = true (paper: post-norm)``), ``not measured``
(its input does not exist yet: the audit never needs the whole pipeline to have run),
``informational`` (context without a paper verdict, e.g. the world size) or ``warning`` (e.g. the
newest checkpoint beats the averaged model on valid). A file that exists but is malformed is an
error naming it.

Verdicts compare with the paper: its settings (:mod:`pipeline.auditing.settings`, with tensor2tensor or
fairseq named where the paper is silent) and what the run measured (tokens per step, averaging span,
dev-set BLEU and perplexity: :mod:`pipeline.auditing.run_items`, :mod:`pipeline.auditing.dev_items`),
never with ``profiles/paper.yaml``, whose differences from params are listed for information only.

Inputs: params.yaml, ``profiles/paper.yaml`` (to list every key a profile changes), the stages'
details JSON, the raw and shards manifests, the newest checkpoint's ``state.json``,
``averaged.pt`` (parameter count), ``dvc.lock`` (read, not a dependency: DVC rewrites it when this
stage runs) and git. The paper's figures live in :mod:`pipeline.auditing.paper` with their sources.
The replay items (:mod:`pipeline.auditing.replay`) also read the hypothesis files, the valid/test
references and the previous ``audit.json``.

The stage logs itself as MLflow child run ``audit`` (both reports as artifacts, the verdict counts,
parameter count and test BLEU as metrics); that run id goes to ``<paths.metrics>/audit.details.json``,
never into the report, which stays a function of its inputs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pipeline.auditing.inputs import load_inputs
from pipeline.auditing.report import build_audit, tracking_metrics
from pipeline.core.config import Params
from pipeline.core.details import AuditDetails
from pipeline.core.stage import stage_main, stage_parser
from pipeline.core.textio import atomic_path, sha256_file

log = logging.getLogger(__name__)


def stage(params: Params, *, params_file: str | Path, lock_file: str | Path, root: str | Path,
          md_path: str | Path, json_path: str | Path) -> AuditDetails:
    """Write the replication audit (``audit.md`` and ``audit.json``, both atomically) and log it to MLflow.

    Args:
        params: the loaded params (``paths`` says where every input lives, relative to ``root``); they
            are compared with the paper and the params dvc.lock recorded (and listed beside
            profiles/paper.yaml, for information).
        params_file: the params.yaml they were loaded from (its sha256 goes into the lineage).
        lock_file: ``dvc.lock`` (optional: without it lineage is "not measured").
        root: the workspace the ``paths`` are relative to (git is asked there).
        md_path: ``audit.md``. json_path: ``audit.json`` (an existing one is the previous audit the
            replay compares with before it is replaced).

    Returns:
        The stage's record (:func:`pipeline.auditing.report.tracking_metrics`): the paper items' verdict counts
        (``matches``, ``deviates``, ``not_measured``), the reference and check counts, ``warnings``,
        ``deviation_topics``, parameter count and test BLEU, and the report's path and sha256 (the audit itself is
        in ``json_path``).

    Raises:
        PipelineError: an input exists but is malformed (names the file).
    """
    from pipeline.auditing.render import render_markdown
    from pipeline.core import tracking

    inp = load_inputs(params, params_file=Path(params_file), lock_file=Path(lock_file), root=Path(root),
                      previous_audit=Path(json_path))
    audit = build_audit(inp)
    text_json = json.dumps(audit, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    numbers = tracking_metrics(audit, inp)
    with atomic_path(json_path) as tmp_json, atomic_path(md_path) as tmp_md:
        tmp_json.write_text(text_json, encoding="utf-8")
        tmp_md.write_text(render_markdown(audit), encoding="utf-8")
    run = tracking.current()
    run.log_metrics(numbers)
    run.set_tags({"profile": audit["profile"], "dataset": audit["dataset"],
                  "audit_json_sha256": sha256_file(json_path)})
    run.log_artifact(md_path)
    run.log_artifact(json_path)
    paper = audit["summary"]["paper"]
    log.info("audit: %d paper items match, %d deviate, %d not measured; %d warning(s) -> %s", paper["matches"],
             paper["deviates"], paper["not measured"], audit["summary"]["warnings"], md_path)
    return AuditDetails(extra={**numbers, "report": str(json_path), "report_sha256": sha256_file(json_path)})


def _run(params: Params, args: argparse.Namespace) -> AuditDetails:
    root = Path(args.root)
    reports = root / params.paths.reports
    return stage(params, params_file=args.params, lock_file=args.lock, root=root, md_path=reports / "audit.md",
                 json_path=reports / "audit.json")


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.audit [--params params.yaml] [--lock dvc.lock] [--root .]``."""
    parser = stage_parser("replication audit: this run beside the paper's base model, with lineage")
    parser.add_argument("--lock", default="dvc.lock", help="dvc.lock to read lineage from (default: dvc.lock)")
    parser.add_argument("--root", default=".", help="workspace the params paths are relative to (default: .)")
    return stage_main("audit", _run, argv, parser)


if __name__ == "__main__":
    sys.exit(main())
