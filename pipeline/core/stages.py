"""The pipeline's stages, in order: the one table the stage CLIs, ``nmt run``, the Prefect flow and the
audit read (``dvc.yaml`` is checked against it by a test).

Each stage writes two files in ``<paths.metrics>``: ``<stage>.json`` with numbers only (what
``dvc.yaml`` declares as metrics, for ``dvc metrics show`` and ``dvc exp show``) and
``<stage>.details.json``, a plain output with everything the stage reported: strings, lists,
signatures, hashes, its timing and its MLflow run id.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import PipelineError


@dataclass(frozen=True)
class Stage:
    """One DVC stage.

    Attributes:
        name: the DVC stage and its MLflow run name.
        module: what ``dvc.yaml`` runs (``python -m <module>``).
        sections: the params.yaml sections its MLflow run logs as params.
        summary: one line for ``--help`` and reports.
        lazy_run: open the MLflow run on first use, not at the start: train first finds the run it
            continues in its checkpoint; register logs only a model it has not registered yet.
    """

    name: str
    module: str
    sections: tuple[str, ...]
    summary: str
    lazy_run: bool = False


STAGES: tuple[Stage, ...] = (
    Stage("download", "pipeline.download", ("download",), "fetch the dataset's parallel text"),
    Stage("clean", "pipeline.clean", ("clean",), "normalise all splits, filter training pairs"),
    Stage("bpe", "pipeline.bpe", ("bpe",), "train the joint SentencePiece BPE model"),
    Stage("encode", "pipeline.encode", ("encode",), "encode cleaned text into Parquet shards"),
    Stage("train", "pipeline.launch", ("seed", "model", "train"),
          "train the Transformer with torchrun (resumes from the newest checkpoint)", lazy_run=True),
    Stage("average", "pipeline.average", ("average",), "average the last checkpoints into averaged.pt"),
    Stage("evaluate", "pipeline.evaluate", ("evaluate",), "beam-decode valid and test, score with sacreBLEU"),
    Stage("register", "pipeline.register", (), "log and register the averaged model in MLflow", lazy_run=True),
    Stage("audit", "pipeline.audit", (), "this run beside the paper, line by line, with its lineage"),
)
NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)


def get(name: str) -> Stage:
    """The stage called ``name``.

    Raises:
        PipelineError: no such stage (the known ones are listed).
    """
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise PipelineError(f"no stage {name!r}; known stages: {', '.join(NAMES)}")


def metrics_file(metrics_dir: str | Path, name: str) -> Path:
    """``<metrics_dir>/<name>.json``: the stage's numbers (DVC metrics)."""
    return Path(metrics_dir) / f"{name}.json"


def details_file(metrics_dir: str | Path, name: str) -> Path:
    """``<metrics_dir>/<name>.details.json``: everything the stage reported, with its run id and timing."""
    return Path(metrics_dir) / f"{name}.details.json"


def numbers(record: dict[str, Any]) -> dict[str, Any]:
    """The numeric leaves of ``record`` (nested mappings kept when they hold numbers; bools, None,
    strings and lists left out)."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            inner = numbers(value)
            if inner:
                out[key] = inner
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    return out


def lock_md5(lock: dict[str, Any], name: str) -> str:
    """A stable md5 of stage ``name``'s entry in a parsed ``dvc.lock`` (empty when it has none)."""
    entry = (lock.get("stages") or {}).get(name)
    if entry is None:
        return ""
    return hashlib.md5(json.dumps(entry, sort_keys=True).encode()).hexdigest()  # a fingerprint, not security
