"""``nmt run``: one pipeline run = one MLflow parent run around ``dvc repro``.

The parent run's id reaches the stages through ``MLFLOW_PARENT_RUN_ID`` in the environment of the
``dvc repro`` subprocess only. After DVC has written ``dvc.lock``, each stage that ran gets its
dvc.lock md5 as a tag (its run id is in its metrics JSON).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from pathlib import Path

import yaml

from pipeline import tracking
from pipeline.config import flatten, load_params, section_dict
from pipeline.errors import PipelineError
from pipeline.profiles import write_profile

log = logging.getLogger(__name__)


def stage_lock_md5(lock: dict, stage: str) -> str:
    """A stable md5 of one stage's entry in dvc.lock (what DVC recorded for it)."""
    entry = lock.get("stages", {}).get(stage)
    if entry is None:
        return ""
    return hashlib.md5(json.dumps(entry, sort_keys=True).encode()).hexdigest()  # noqa: S324 - fingerprint


def _tag_stage_runs(root: Path, metrics_dir: Path) -> None:
    lock_path = root / "dvc.lock"
    if not lock_path.is_file():
        return
    lock = yaml.safe_load(lock_path.read_text(encoding="utf-8")) or {}
    for stage in lock.get("stages", {}):
        metrics = metrics_dir / f"{stage}.json"
        if not metrics.is_file():
            continue
        run_id = json.loads(metrics.read_text(encoding="utf-8")).get("mlflow_run_id")
        if run_id:
            tracking.tag_run(run_id, {"dvc_lock_md5": stage_lock_md5(lock, stage)}, root)


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
        _tag_stage_runs(root, root / params.paths.metrics)
        if rc != 0:
            raise PipelineError(f"`{' '.join(cmd)}` failed with exit code {rc}; see the stage output above")
    return rc
