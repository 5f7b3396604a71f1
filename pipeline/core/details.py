"""What the stages report, as typed records (``<paths.metrics>/<stage>.details.json``) for the audit and the flows:
``from_json`` checks each field's type (a one-line error names file and key) and keeps other keys in ``extra``."""

from __future__ import annotations

import functools
import json
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Self

from pipeline.core import stages
from pipeline.core.errors import DataError, PipelineError

#: The scores a scored set holds (pipeline/inference/scoring.py ``METRIC_KEYS``, in its order).
METRICS = ("bleu", "bleu_lc", "bleu_intl", "bleu_intl_lc", "chrf2", "bleu_tok_split")


@dataclass(frozen=True, kw_only=True)
class Record:
    """A JSON object with typed fields; ``extra`` holds the keys the record does not name, as read."""

    extra: dict[str, object] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: object, where: str, prefix: str = "") -> Self:
        """The record of JSON object ``data`` read from ``where`` (``prefix``: the keys above it, for errors).

        Raises:
            DataError: ``data`` is not an object, or a field has the wrong type (names ``where`` and the key).
        """
        if not isinstance(data, dict):
            _fail(where, prefix.rstrip("."), "a JSON object", type(data).__name__)
        hints = _hints(cls)
        known = {key: _check(data[key], hint, where, prefix + key) for key, hint in hints.items()
                 if data.get(key) is not None}
        return cls(**known, extra={k: v for k, v in data.items() if k not in hints})

    def to_json(self) -> dict[str, object]:
        """The JSON object: every field (None as null, nested records as objects), then ``extra``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {k: v.to_json() if isinstance(v, Record) else v for k, v in out.items()} | self.extra


@dataclass(frozen=True, kw_only=True)
class StageDetails(Record):
    """What every stage's details file has: its MLflow run id (None while tracking is off)."""

    STAGE: ClassVar[str] = ""
    mlflow_run_id: str | None = None

    @classmethod
    def read(cls, metrics_dir: str | Path, stage: str | None = None) -> Self | None:
        """``<metrics_dir>/<STAGE>.details.json`` (``stage``'s, when given), or None when not written yet.

        Raises:
            PipelineError: not valid JSON; DataError: not an object or a field of the wrong type (names the file).
        """
        path = stages.details_file(metrics_dir, stage or cls.STAGE)
        return cls.from_json(read_json(path), str(path)) if path.is_file() else None


@dataclass(frozen=True, kw_only=True)
class DownloadDetails(StageDetails):
    """``dataset`` and the sentence ``pairs`` per split (train, valid, test)."""

    STAGE: ClassVar[str] = "download"
    dataset: str | None = None
    pairs: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class PairCounts(Record):
    """One split through the clean stage: pairs read and kept (``extra``: the drops per rule, blanks)."""

    pairs_in: int | None = None
    pairs_out: int | None = None


@dataclass(frozen=True, kw_only=True)
class CleanDetails(StageDetails):
    """The pair counts per split."""

    STAGE: ClassVar[str] = "clean"
    train: PairCounts = field(default_factory=PairCounts)
    valid: PairCounts = field(default_factory=PairCounts)
    test: PairCounts = field(default_factory=PairCounts)


@dataclass(frozen=True, kw_only=True)
class BpeDetails(StageDetails):
    """The vocabulary built and the sha256 of ``spm.model``."""

    STAGE: ClassVar[str] = "bpe"
    vocab_size: int | None = None
    spm_sha256: str | None = None


@dataclass(frozen=True, kw_only=True)
class EncodeDetails(StageDetails):
    """Nothing a reader needs beyond the run id (the shards manifest describes the shards)."""

    STAGE: ClassVar[str] = "encode"


@dataclass(frozen=True, kw_only=True)
class Machine(Record):
    """The CPU a stage's numbers came from: its model, the vector instructions torch's CPU kernels use
    (``torch.backends.cpu.get_cpu_capability()``: DEFAULT, AVX2, AVX512...), torch's threads, torch's version.
    Two CPUs of different capability may give different last bits, and so different BLEU."""

    cpu: str | None = None
    cpu_capability: str | None = None
    threads: int | None = None
    torch: str | None = None

    @classmethod
    def here(cls) -> Machine:
        """This process's machine (torch imported here: the stages that call this use it anyway)."""
        import platform

        import torch

        try:
            lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
            cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
        except OSError:
            cpu = None
        return cls(cpu=cpu or platform.processor() or platform.machine(),
                   cpu_capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads(),
                   torch=str(torch.__version__))

    def describe(self) -> str | None:
        """``AMD EPYC, AVX2, 2 threads, torch 2.13.0`` (None when nothing was recorded)."""
        if self.cpu is None:
            return None
        return f"{self.cpu}, {self.cpu_capability}, {self.threads} threads, torch {self.torch}"


@dataclass(frozen=True, kw_only=True)
class TrainDetails(StageDetails):
    """Where training ended and what it measured (pipeline/training/loop.py): target (and source) tokens and forward
    passes per optimizer step (forwards: the busiest rank), ``wall_seconds`` of this invocation, ``train_seconds``
    of step time over all (``resumed_from_step`` None: trained from scratch), the last validation's perplexity, and
    ``folder`` it trained in and ``checkpoints``: each complete checkpoint kept (step folder -> its model.pt's sha256),
    what average and evaluate read: their DVC dependency, where the checkpoint folder is none (dvc.yaml)."""

    STAGE: ClassVar[str] = "train"
    step: int | None = None
    tokens_seen: int | None = None
    world_size: int | None = None
    tokens_per_step_mean: float | None = None
    tokens_per_step_std: float | None = None
    tokens_per_step_min: float | None = None
    tokens_per_step_max: float | None = None
    src_tokens_per_step_mean: float | None = None
    forwards_per_step_mean: float | None = None
    forwards_per_step_max: int | None = None
    device: str | None = None
    device_name: str | None = None
    wall_seconds: float | None = None
    train_seconds: float | None = None
    resumed_from_step: int | None = None
    valid_ppl: float | None = None
    folder: str | None = None
    checkpoints: dict[str, str] = field(default_factory=dict)
    machine: Machine = field(default_factory=Machine)


@dataclass(frozen=True, kw_only=True)
class AverageDetails(StageDetails):
    """The averaged checkpoints' ``steps`` (ascending), the ``parameters`` counted and the BPE model's sha256."""

    STAGE: ClassVar[str] = "average"
    steps: list[int] = field(default_factory=list)
    parameters: int | None = None
    spm_sha256: str | None = None


@dataclass(frozen=True, kw_only=True)
class SetFigures(Record):
    """One decoded and scored set: :data:`METRICS`, their ``signatures``, its size; ``ppl`` on valid sets,
    ``truncated_sources`` on the averaged model's, ``step`` on the newest checkpoint's."""

    bleu: float | None = None
    bleu_lc: float | None = None
    bleu_intl: float | None = None
    bleu_intl_lc: float | None = None
    chrf2: float | None = None
    bleu_tok_split: float | None = None
    signatures: dict[str, str] = field(default_factory=dict)
    sentences: int | None = None
    ppl: float | None = None
    truncated_sources: int | None = None
    step: int | None = None

    def scores(self) -> dict[str, float | None]:
        """Every metric of :data:`METRICS` (None: not scored)."""
        return {key: getattr(self, key) for key in METRICS}


@dataclass(frozen=True, kw_only=True)
class Chosen(Record):
    """The beam and α chosen on ``chosen_on`` (the valid set) and used for test."""

    beam: int | None = None
    alpha: float | None = None
    chosen_on: str | None = None


@dataclass(frozen=True, kw_only=True)
class EvaluateDetails(StageDetails):
    """The averaged model on ``valid`` and ``test``, the newest checkpoint on ``valid_newest``, the decoding chosen."""

    STAGE: ClassVar[str] = "evaluate"
    valid: SetFigures = field(default_factory=SetFigures)
    test: SetFigures = field(default_factory=SetFigures)
    valid_newest: SetFigures = field(default_factory=SetFigures)
    chosen: Chosen = field(default_factory=Chosen)
    device: str | None = None
    machine: Machine = field(default_factory=Machine)


@dataclass(frozen=True, kw_only=True)
class RegisterDetails(StageDetails):
    """The registry decision (pipeline/register.py): the version registered and who holds the alias."""

    STAGE: ClassVar[str] = "register"
    tracking: str | None = None
    model_name: str | None = None
    model_version: str | None = None
    alias: str | None = None
    alias_moved: bool | None = None
    candidate_version: str | None = None
    decision: str | None = None


@dataclass(frozen=True, kw_only=True)
class AuditDetails(StageDetails):
    """The audit's counts (their meaning: pipeline/auditing/report.py ``tracking_metrics``) are in ``extra``."""

    STAGE: ClassVar[str] = "audit"


#: The record of each stage, in the stage table's order.
RECORDS: dict[str, type[StageDetails]] = {cls.STAGE: cls for cls in (
    DownloadDetails, CleanDetails, BpeDetails, EncodeDetails, TrainDetails, AverageDetails, EvaluateDetails,
    RegisterDetails, AuditDetails)}


@dataclass(frozen=True)
class RunDetails:
    """The records of the stages up to evaluate in one workspace; ``written``: the stages whose file exists."""

    download: DownloadDetails = field(default_factory=DownloadDetails)
    clean: CleanDetails = field(default_factory=CleanDetails)
    bpe: BpeDetails = field(default_factory=BpeDetails)
    encode: EncodeDetails = field(default_factory=EncodeDetails)
    train: TrainDetails = field(default_factory=TrainDetails)
    average: AverageDetails = field(default_factory=AverageDetails)
    evaluate: EvaluateDetails = field(default_factory=EvaluateDetails)
    written: frozenset[str] = frozenset()

    @classmethod
    def read(cls, metrics_dir: str | Path) -> RunDetails:
        """Every stage's details file in ``metrics_dir`` (raises as :meth:`StageDetails.read` does)."""
        found = {name: RECORDS[name].read(metrics_dir) for name in _RUN_STAGES}
        written = {name: record for name, record in found.items() if record is not None}
        return cls(**written, written=frozenset(written))

    def run_ids(self) -> dict[str, str | None]:
        """The MLflow run id of each stage that wrote its details, in the stage table's order."""
        return {name: getattr(self, name).mlflow_run_id for name in _RUN_STAGES if name in self.written}


_RUN_STAGES = tuple(f.name for f in fields(RunDetails) if f.name != "written")


def read_json(path: str | Path) -> Any:
    """Read a JSON file, naming it in the error if it is missing or malformed."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(f"{path}: not found; run the upstream stage first (dvc repro)") from None
    except json.JSONDecodeError as exc:
        raise PipelineError(f"{path}: not valid JSON ({exc}); delete it and rerun the stage that writes it") from None


@functools.cache
def _hints(cls: type[Record]) -> dict[str, object]:
    """The record's field types (``extra`` and class variables left out)."""
    names = {f.name for f in fields(cls)} - {"extra"}
    return {name: hint for name, hint in typing.get_type_hints(cls).items() if name in names}


def _check(value: object, hint: object, where: str, key: str) -> object:
    """``value`` when it has type ``hint`` (nested records read); else a one-line DataError naming the key."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType:  # ``X | None``
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_json(value, where, key + ".")
    if origin is list and isinstance(value, list):
        return [_check(v, args[0], where, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict and isinstance(value, dict):
        return {k: _check(v, args[1], where, f"{key}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(hint, type) and type(value) is hint:  # a bool is no int here
        return value
    shown = json.dumps(value)
    _fail(where, key, {float: "a number", int: "an integer", str: "a string", bool: "true or false"}.get(
        hint, "a JSON array" if origin is list else "a JSON object"), shown if len(shown) <= 40 else shown[:37] + "...")


def _fail(where: str, key: str, expected: str, got: str) -> typing.NoReturn:
    raise DataError(f"{where}: {key + ': ' if key else ''}expected {expected}, got {got}; "
                    "rerun the stage that writes it")
