"""What the evaluate stage reports (``evaluate.details.json``): per decoded set its scores and how it was decoded,
the (beam, α) grid on valid and the decoding chosen, as typed records (pipeline/core/record.py)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from pipeline.core.record import Machine, Record, StageDetails

#: The scores a scored set holds (pipeline/inference/scoring.py ``METRIC_KEYS``, in its order).
METRICS = ("bleu", "bleu_lc", "bleu_intl", "bleu_intl_lc", "chrf2", "bleu_tok_split")


class SetFigures(Record):
    """One decoded and scored set: :data:`METRICS`, their ``signatures`` and sacreBLEU lines, its size, how it was
    decoded; ``ppl`` and what it was computed on for valid sets, ``step`` and ``checkpoint`` on the newest
    checkpoint's."""

    bleu: float | None = None
    bleu_lc: float | None = None
    bleu_intl: float | None = None
    bleu_intl_lc: float | None = None
    chrf2: float | None = None
    bleu_tok_split: float | None = None
    signatures: dict[str, str] = Field(default_factory=dict)  # metric -> sacreBLEU signature
    verbose: dict[str, str] = Field(default_factory=dict)  # metric -> sacreBLEU's detail line
    sentences: int | None = None
    decode_seconds: float | None = None
    sentences_per_second: float | None = None
    beam: int | None = None
    alpha: float | None = None
    truncated_sources: int | None = None  # sources cut to the model's max_positions
    hypotheses: str | None = None  # the hypothesis file scored
    reference: str | None = None  # the raw reference it was scored against
    nll: float | None = None  # nats per target token (valid sets)
    ppl: float | None = None  # exp(nll)
    ppl_tokens: int | None = None  # target tokens the perplexity was computed on
    ppl_skipped: int | None = None  # pairs too long for the model, left out of it
    step: int | None = None  # the newest checkpoint's step (valid_newest)
    checkpoint: str | None = None  # the newest checkpoint's folder (valid_newest)

    def scores(self) -> dict[str, float | None]:
        """Every metric of :data:`METRICS` (None: not scored)."""
        return {key: getattr(self, key) for key in METRICS}


class GridPoint(Record):
    """One (beam, α) of the grid on valid: its BLEU and the seconds of its beam size's decode (all its α's)."""

    beam: int
    alpha: float
    bleu: float
    decode_seconds: float


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
    grid: list[GridPoint] = Field(default_factory=list)  # every (beam, α) tried on valid, in decode order
    chosen: Chosen = Field(default_factory=Chosen)
    device: str | None = None  # the device it decoded on
    machine: Machine = Field(default_factory=Machine)
