"""The pipeline's stages, in order: the one table the stage CLIs, ``nmt run``, the Prefect flow and the audit read."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from pipeline.core.errors import PipelineError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    """One DVC stage."""

    name: str  # the DVC stage and its MLflow run name
    module: str  # what dvc.yaml runs (python -m <module>)
    sections: tuple[str, ...]  # the params.yaml sections its MLflow run logs as params
    summary: str  # one line for --help and reports
    # Open the MLflow run on first use: train first finds the run it continues in its checkpoint, register
    # logs only a model it has not registered yet.
    lazy_run: bool = False
    metrics: tuple[str, ...] = ()  # dotted keys of its record that <stage>.json holds (none: no such file)


STAGES: tuple[Stage, ...] = (
    Stage("download", "pipeline.download", ("download",), "fetch the dataset's parallel text"),
    Stage("clean", "pipeline.clean", ("clean",), "normalise all splits, filter training pairs"),
    Stage("bpe", "pipeline.bpe", ("bpe",), "train the joint SentencePiece BPE model"),
    Stage("encode", "pipeline.encode", ("encode",), "encode cleaned text into Parquet shards"),
    Stage("train", "pipeline.launch", ("seed", "model", "train"),
          "train the Transformer with torchrun (resumes from the newest checkpoint)", lazy_run=True,
          metrics=("step", "tokens_seen")),
    Stage("average", "pipeline.average", ("average",), "average the last checkpoints into averaged.pt"),
    Stage("evaluate", "pipeline.evaluate", ("evaluate",), "beam-decode valid and test, score with sacreBLEU",
          metrics=("valid.bleu", "valid.chrf2", "valid.ppl", "test.bleu", "test.chrf2")),
    Stage("register", "pipeline.register", (), "log and register the averaged model in MLflow", lazy_run=True),
    Stage("audit", "pipeline.audit", (), "this run beside the paper, line by line, with its lineage"),
)
NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)


def get(name: str) -> Stage:
    """The stage called ``name`` (a PipelineError listing the known ones if none)."""
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise PipelineError(f"no stage {name!r}; known stages: {', '.join(NAMES)}")


def metrics_file(metrics_dir: str | Path, name: str) -> Path:
    """``<metrics_dir>/<name>.json``: the stage's few numbers (DVC metrics; only stages with ``metrics``)."""
    return Path(metrics_dir) / f"{name}.json"


def details_file(metrics_dir: str | Path, name: str) -> Path:
    """``<metrics_dir>/<name>.details.json``: everything the stage reported, with its run id and timing."""
    return Path(metrics_dir) / f"{name}.details.json"


def summary(name: str, record: dict[str, object]) -> dict[str, float | dict[str, float]] | None:
    """What ``<name>.json`` holds: the stage's ``metrics`` keys (``step``, ``valid.bleu``) of the JSON of its record
    (None for a stage without any)."""
    if not (keys := get(name).metrics):
        return None
    out: dict[str, float | dict[str, float]] = {}
    for key in keys:
        value: object = record
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            log.warning("stage %s reported no number %s (got %r): left out of its DVC metrics", name, key, value)
            continue
        section, _, leaf = key.rpartition(".")
        if not section:
            out[leaf] = value
        elif isinstance(node := out.setdefault(section, {}), dict):
            node[leaf] = value
    return out


class LockFile(TypedDict, total=False):
    """One dep or out of a ``dvc.lock`` stage (DVC 3: a file's md5, a folder's ``<md5>.dir``)."""

    path: str
    hash: str  # the hash's name (md5)
    md5: str
    size: int
    nfiles: int  # a folder's files


class LockStage(TypedDict, total=False):
    """One stage of a parsed ``dvc.lock``."""

    cmd: str
    deps: list[LockFile]
    params: dict[str, dict[str, object]]  # params file -> the dotted keys it reads and their values
    outs: list[LockFile]


class DvcLock(TypedDict, total=False):
    """A parsed ``dvc.lock`` (as read: a key may be absent)."""

    schema: str
    stages: dict[str, LockStage]


def lock_md5(lock: DvcLock, name: str) -> str:
    """A stable md5 of stage ``name``'s entry in a parsed ``dvc.lock`` (empty when it has none)."""
    if (entry := (lock.get("stages") or {}).get(name)) is None:
        return ""
    return hashlib.md5(json.dumps(entry, sort_keys=True).encode()).hexdigest()  # a fingerprint, not security
