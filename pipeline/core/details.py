"""What the stages report, as typed records (``<paths.metrics>/<stage>.details.json``) for the audit and the flows:
pydantic models (pipeline/core/record.py) whose writers name only declared fields and whose ``from_json`` checks
each field's type (a one-line error names file and key) and keeps the keys an older or newer file has in ``extra``.
The data stages' records are in pipeline/core/data_details.py, evaluate's in pipeline/core/figures.py."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from pipeline.core.data_details import BpeDetails, CleanDetails, DownloadDetails, EncodeDetails
from pipeline.core.figures import METRICS, Chosen, EvaluateDetails, GridPoint, SetFigures
from pipeline.core.record import Machine, Record, StageDetails, read_json

__all__ = ["METRICS", "RECORDS", "AuditDetails", "AverageDetails", "BpeDetails", "Chosen", "CleanDetails",
           "DownloadDetails", "EncodeDetails", "EvaluateDetails", "GridPoint", "Machine", "Record", "RegisterDetails",
           "RunDetails", "SetFigures", "StageDetails", "TrainDetails", "read_json"]


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
    epoch: int | None = None  # epochs begun
    max_tokens: int | None = None  # tokens per forward pass the batches were planned for
    global_batches: int | None = None  # batches of an epoch's plan
    train_loss: float | None = None  # the last logged interval's label-smoothed loss per target token
    train_nll: float | None = None  # its NLL per target token
    train_ppl: float | None = None  # exp(train_nll)
    valid_loss: float | None = None  # the last validation's loss per target token
    valid_nll: float | None = None  # its NLL per target token
    tgt_tokens_per_s: float | None = None  # target tokens per second of step time
    oom_skipped_steps: int | None = None  # steps skipped after running out of accelerator memory


class AverageDetails(StageDetails):
    """The averaged checkpoints (ascending), those skipped, the ``parameters`` counted and the BPE model's sha256."""

    STAGE: ClassVar[str] = "average"
    checkpoints: list[str] = Field(default_factory=list)  # their step folders' names
    steps: list[int] = Field(default_factory=list)
    requested: int | None = None  # average.last_n
    used: int | None = None  # checkpoints averaged
    fewer_than_requested: bool | None = None
    skipped_incomplete: list[str] = Field(default_factory=list)  # newer step folders without DONE
    parameters: int | None = None  # floating-point weights
    spm_sha256: str | None = None


class RegisteredFigures(Record):
    """The figures a registered version is tagged with (and compared by)."""

    valid_bleu: float | None = None
    test_bleu: float | None = None
    beam: int | None = None
    alpha: float | None = None


class PreviousCandidate(Record):
    """The version that held the alias before this registration."""

    version: str | None = None
    run_id: str | None = None
    valid_bleu: float | None = None
    test_bleu: float | None = None


class PairedBootstrap(Record):
    """sacreBLEU's paired bootstrap of the new model against the candidate on test (pipeline/tracking/promotion.py)."""

    p_value: float | None = None  # the chance of a BLEU difference at least this large
    n_samples: int | None = None
    signature: str | None = None
    identical_hypotheses: bool | None = None
    new_bleu: float | None = None
    new_mean: float | None = None
    new_ci: float | None = None
    candidate_bleu: float | None = None
    candidate_mean: float | None = None
    candidate_ci: float | None = None


class DatasetInput(Record):
    """A DVC output logged as the register run's MLflow dataset input."""

    name: str | None = None
    digest: str | None = None  # its md5 in dvc.lock
    context: str | None = None  # MLflow's dataset context: source or training




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
    new: RegisteredFigures = Field(default_factory=RegisteredFigures)  # this model's figures
    model_uri: str | None = None  # the logged MLflow model
    registered_uri: str | None = None  # models:/<name>/<version>
    previous_candidate: PreviousCandidate | None = None
    paired_bootstrap: PairedBootstrap | None = None
    paired_bootstrap_skipped: str | None = None  # why no bootstrap was run
    datasets: list[DatasetInput] = Field(default_factory=list)


class AuditDetails(StageDetails):
    """The audit's counts (pipeline/auditing/report.py ``tracking_metrics``) and the report it wrote."""

    STAGE: ClassVar[str] = "audit"
    matches: int | None = None  # paper items that match
    deviates: int | None = None  # paper items that deviate
    not_measured: int | None = None  # paper items not measured
    reference_matches: int | None = None  # items the paper is silent on, matching the reference setup
    reference_deviates: int | None = None
    checks_passed: int | None = None  # consistency checks
    checks_failed: int | None = None
    warnings: int | None = None
    deviation_topics: int | None = None
    parameters: int | None = None  # the model's parameters
    test_bleu: float | None = None
    test_bleu_tok_split: float | None = None
    replay_identical: float | None = None  # 1.0: every replayed figure matched (absent: nothing replayed)
    report: str | None = None  # audit.json
    report_sha256: str | None = None


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
