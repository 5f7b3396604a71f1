"""The typed JSON records the stages write (``<paths.metrics>/<stage>.details.json``): pydantic models whose writers
name only declared fields (an unknown one is an error) and whose readers (:meth:`Record.from_json`) check each
field's type (a one-line error names file and key) and keep the keys of older or newer files in ``extra``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from pipeline.core import stages
from pipeline.core.errors import DataError, PipelineError

#: The validation context of a read: the keys a record does not name are kept, not refused.
_READ = {"read": True}


class Record(BaseModel):
    """A JSON object with typed fields (strict: ``"2"`` is no number, ``true`` no integer). A writer names only
    declared fields (another is a ValidationError: a bug in the writer); a file read keeps the keys the record does
    not name, as read, in :attr:`extra`."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _absent(cls, data: Any) -> Any:
        """A known key holding null reads as absent."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}

    @model_validator(mode="after")
    def _known(self, info: ValidationInfo) -> Self:
        """Refuse a field the record does not declare, unless read from a file."""
        if self.model_extra and not (info.context or {}).get("read"):
            raise ValueError(f"{type(self).__name__} declares no field {', '.join(sorted(self.model_extra))}")
        return self

    def replace(self, **changes: object) -> Self:
        """A copy with ``changes`` (declared fields, as keywords), checked as a new record is (a record read with
        unknown keys keeps them)."""
        return type(self).model_validate({**dict(self), **changes}, context=_READ if self.model_extra else None)

    @property
    def extra(self) -> dict[str, object]:
        """The keys the record does not name, as read."""
        return dict(self.model_extra or {})

    @classmethod
    def from_json(cls, data: object, where: str) -> Self:
        """The record of JSON object ``data`` read from ``where`` (unknown keys kept in :attr:`extra`).

        Raises:
            DataError: ``data`` is not an object, or a field has the wrong type (names ``where`` and the key).
        """
        try:
            return cls.model_validate(data, context=_READ)
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
    """What every stage's details file has: its MLflow run id (None while tracking is off) and its seconds (both
    set by the stage harness, pipeline/tracking/harness.py)."""

    STAGE: ClassVar[str] = ""
    mlflow_run_id: str | None = None
    seconds: float | None = None  # wall seconds of the stage body and its bookkeeping

    @classmethod
    def read(cls, metrics_dir: str | Path, stage: str | None = None) -> Self | None:
        """``<metrics_dir>/<STAGE>.details.json`` (``stage``'s, when given), or None when not written yet.

        Raises:
            PipelineError: not valid JSON; DataError: not an object or a field of the wrong type (names the file).
        """
        path = stages.details_file(metrics_dir, stage or cls.STAGE)
        return cls.from_json(read_json(path), str(path)) if path.is_file() else None


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


def read_json(path: str | Path) -> Any:
    """Read a JSON file, naming it in the error if it is missing or malformed."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(f"{path}: not found; run the upstream stage first (dvc repro)") from None
    except json.JSONDecodeError as exc:
        raise PipelineError(f"{path}: not valid JSON ({exc}); delete it and rerun the stage that writes it") from None
