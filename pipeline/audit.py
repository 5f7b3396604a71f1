"""Stage ``audit``: this run beside the paper's base model, item by item, with its lineage (docs/tracking.md,
"The audit"), as ``<paths.reports>/audit.md`` and ``audit.json``, a function of the inputs only."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pipeline.auditing.inputs import load_inputs
from pipeline.auditing.report import build_audit, tracking_metrics
from pipeline.core.config import Params
from pipeline.core.console import stage_parser
from pipeline.core.details import AuditDetails
from pipeline.core.errors import ConfigError
from pipeline.core.owned import atomic_path
from pipeline.core.textio import sha256_file
from pipeline.core.yamlfile import load_yaml
from pipeline.tracking.harness import stage_main

log = logging.getLogger(__name__)


def stage(params: Params, *, params_file: str | Path, lock_file: str | Path, root: str | Path,
          md_path: str | Path, json_path: str | Path) -> AuditDetails:
    """Write the audit of ``params`` (loaded from ``params_file``; its ``paths`` relative to ``root``) to ``md_path``
    and ``json_path`` atomically and log it to MLflow; return its :func:`pipeline.auditing.report.tracking_metrics`
    and the report's path and sha256. A missing input (``lock_file`` too) is "not measured", a malformed one an
    error naming it; the previous audit the replay compares with is ``json_path`` or, when DVC deleted it before
    this run (a declared output), its copy in DVC's cache (:func:`previous_audit`)."""
    from pipeline.auditing.render import render_markdown
    from pipeline import tracking

    inp = load_inputs(params, params_file=Path(params_file), lock_file=Path(lock_file), root=Path(root),
                      previous_audit=previous_audit(Path(json_path), Path(lock_file), Path(root)))
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
    return AuditDetails(**numbers, report=str(json_path), report_sha256=sha256_file(json_path))


def previous_audit(json_path: Path, lock_file: Path, root: Path) -> Path | None:
    """``json_path`` if it is there, else the cached object dvc.lock's audit entry names
    (``.dvc/cache/files/md5/<2>/<30>``, DVC 3's cache layout), else None."""
    if json_path.is_file():
        return json_path
    try:
        outs = load_yaml(lock_file)["stages"]["audit"]["outs"]
        md5 = next(out["md5"] for out in outs if root / out["path"] == json_path)
    except (OSError, ConfigError, KeyError, TypeError, StopIteration):
        return None
    cached = root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
    return cached if cached.is_file() else None


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
