"""What the stages report, as typed records (``<paths.metrics>/<stage>.details.json``) for the audit and the flows:
pydantic models whose ``from_json`` checks each field's type (a one-line error names file and key) and keeps
other keys in ``extra``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.core import stages
from pipeline.core.errors import DataError, PipelineError

#: The scores a scored set holds (pipeline/inference/scoring.py ``METRIC_KEYS``, in its order).
METRICS = ("bleu", "bleu_lc", "bleu_intl", "bleu_intl_lc", "chrf2", "bleu_tok_split")


class Record(BaseModel):
    """A JSON object with typed fields (strict: ``"2"`` is no number, ``true`` no integer); the keys the record does
    not name are kept as read, in :attr:`extra` (a writer may pass them as ``extra={...}``)."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _absent(cls, data: Any) -> Any:
        """A known key holding null reads as absent; ``extra={...}`` from a writer joins the other keys."""
        if not isinstance(data, dict):
            return data
        data = {**data.get("extra", {}), **{k: v for k, v in data.items() if k != "extra"}} if isinstance(
            data.get("extra"), dict) else data
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}

    @property
    def extra(self) -> dict[str, object]:
        """The keys the record does not name, as read."""
        return dict(self.model_extra or {})

    @classmethod
    def from_json(cls, data: object, where: str) -> Self:
        """The record of JSON object ``data`` read from ``where``.

        Raises:
            DataError: ``data`` is not an object, or a field has the wrong type (names ``where`` and the key).
        """
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            key = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in error["loc"]).replace(".[", "[")
            expected = _EXPECTED.get(error["type"], error["msg"])
            got = error["input"]
            shown = type(got).__name__ if isinstance(got, (dict, list)) else json.dumps(got, default=str)
            raise DataError(f"{where}: {key + ': ' if key else ''}expected {expected}, got "
                            f"{shown if len(shown) <= 40 else shown[:37] + '...'}; rerun the stage that writes it"
                            ) from None

    def to_json(self) -> dict[str, object]:
        """The JSON object: every field (None as null, nested records as objects), then ``extra``."""
        return self.model_dump(mode="json")


#: How a wrong type's error says what was expected.
_EXPECTED = {"float_type": "a number", "int_type": "an integer", "int_from_float": "an integer",
             "string_type": "a string", "bool_type": "true or false", "list_type": "a JSON array",
             "dict_type": "a JSON object", "model_type": "a JSON object"}


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


class DownloadDetails(StageDetails):
    """``dataset`` and the sentence ``pairs`` per split (train, valid, test)."""

    STAGE: ClassVar[str] = "download"
    dataset: str | None = None
    pairs: dict[str, int] = Field(default_factory=dict)


class PairCounts(Record):
    """One split through the clean stage: pairs read and kept (``extra``: the drops per rule, blanks)."""

    pairs_in: int | None = None
    pairs_out: int | None = None


class CleanDetails(StageDetails):
    """The pair counts per split."""

    STAGE: ClassVar[str] = "clean"
    train: PairCounts = Field(default_factory=PairCounts)
    valid: PairCounts = Field(default_factory=PairCounts)
    test: PairCounts = Field(default_factory=PairCounts)


class BpeDetails(StageDetails):
    """The vocabulary built and the sha256 of ``spm.model``."""

    STAGE: ClassVar[str] = "bpe"
    vocab_size: int | None = None
    spm_sha256: str | None = None


class EncodeDetails(StageDetails):
    """Nothing a reader needs beyond the run id (the shards manifest describes the shards)."""

    STAGE: ClassVar[str] = "encode"


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
    checkpoints: dict[str, str] = Field(default_factory=dict)
    machine: Machine = Field(default_factory=Machine)


class AverageDetails(StageDetails):
    """The averaged checkpoints' ``steps`` (ascending), the ``parameters`` counted and the BPE model's sha256."""

    STAGE: ClassVar[str] = "average"
    steps: list[int] = Field(default_factory=list)
    parameters: int | None = None
    spm_sha256: str | None = None


class SetFigures(Record):
    """One decoded and scored set: :data:`METRICS`, their ``signatures``, its size; ``ppl`` on valid sets,
    ``truncated_sources`` on the averaged model's, ``step`` on the newest checkpoint's."""

    bleu: float | None = None
    bleu_lc: float | None = None
    bleu_intl: float | None = None
    bleu_intl_lc: float | None = None
    chrf2: float | None = None
    bleu_tok_split: float | None = None
    signatures: dict[str, str] = Field(default_factory=dict)
    sentences: int | None = None
    ppl: float | None = None
    truncated_sources: int | None = None
    step: int | None = None

    def scores(self) -> dict[str, float | None]:
        """Every metric of :data:`METRICS` (None: not scored)."""
        return {key: getattr(self, key) for key in METRICS}


class Chosen(Record):
    """The beam and α chosen on ``chosen_on`` (the valid set) and used for test."""

    beam: int | None = None
    alpha: float | None = None
    chosen_on: str | None = None


class EvaluateDetails(StageDetails):
    """The averaged model on ``valid`` and ``test``, the newest checkpoint on ``valid_newest``, the decoding chosen."""

    STAGE: ClassVar[str] = "evaluate"
    valid: SetFigures = Field(default_factory=SetFigures)
    test: SetFigures = Field(default_factory=SetFigures)
    valid_newest: SetFigures = Field(default_factory=SetFigures)
    chosen: Chosen = Field(default_factory=Chosen)
    device: str | None = None
    machine: Machine = Field(default_factory=Machine)


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
