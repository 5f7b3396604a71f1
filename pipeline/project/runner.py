"""``nmt run``: one pipeline run = one MLflow parent run around ``dvc repro``.

The parent run's id reaches the stages through ``MLFLOW_PARENT_RUN_ID`` in the environment of the
``dvc repro`` subprocess only. After DVC has written ``dvc.lock``, each stage that ran gets its
dvc.lock md5 as a tag (its run id is in its metrics JSON).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import yaml

from pipeline.core import stages as stage_table
from pipeline.core import tracking
from pipeline.core.config import flatten, load_params, section_dict
from pipeline.core.errors import PipelineError
from pipeline.project.profiles import write_profile

log = logging.getLogger(__name__)


def tag_stage_run(root: Path, metrics_dir: Path, stage: str,
                  parent: tracking.StageRun | None = None) -> str | None:
    """Tag ``stage``'s MLflow run with its dvc.lock md5 (and the parent with ``produced_by.<stage>``).

    Returns:
        The stage's run id, or None when it has none (tracking off, stage never ran).
    """
    lock_path, metrics = root / "dvc.lock", root / stage_table.details_file(metrics_dir, stage)
    if not (tracking.enabled() and lock_path.is_file() and metrics.is_file()):
        return None
    try:
        run_id = json.loads(metrics.read_text(encoding="utf-8")).get("mlflow_run_id")
        if not run_id:
            return None
        lock = yaml.safe_load(lock_path.read_text(encoding="utf-8")) or {}
        tracking.tag_run(run_id, {"dvc_lock_md5": stage_table.lock_md5(lock, stage)}, root)
        if parent is not None:
            parent.set_tags({f"produced_by.{stage}": run_id})
    except Exception as exc:  # noqa: BLE001 - tracking must never fail the pipeline
        log.warning("could not tag the MLflow run of stage %s: %s", stage, exc)
        return None
    return run_id


def _stages(root: Path) -> list[str]:
    lock_path = root / "dvc.lock"
    lock = yaml.safe_load(lock_path.read_text(encoding="utf-8")) if lock_path.is_file() else None
    return list((lock or {}).get("stages", {}))


def run_pipeline(*, stages: list[str], profile: str | None = None, force: bool = False,
                 root: str | Path = ".") -> int:
    """Write the profile (if given), then ``dvc repro [stages]`` under a parent MLflow run.

    Returns:
        dvc's exit code.
    """
    root = Path(root)
    if profile:
        write_profile(profile, root)
    params = load_params(root / "params.yaml")
    flat = flatten(section_dict(params))
    cmd = ["dvc", "repro", *stages] + (["--force"] if force else [])
    with tracking.pipeline_run(f"pipeline-{params.profile}", params=flat, root=root) as parent:
        env = dict(os.environ)
        if parent.run_id:
            env["MLFLOW_PARENT_RUN_ID"] = parent.run_id
        log.info("running %s (profile %s)", " ".join(cmd), params.profile)
        try:
            rc = subprocess.run(cmd, cwd=root, env=env, check=False).returncode
        except FileNotFoundError:
            raise PipelineError("dvc not found on PATH: run `make install` and use .venv/bin/nmt") from None
        for stage in _stages(root):
            tag_stage_run(root, Path(params.paths.metrics), stage, parent)
        if rc != 0:
            raise PipelineError(f"`{' '.join(cmd)}` failed with exit code {rc}; see the stage output above")
    return rc
