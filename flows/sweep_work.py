"""Where a sweep's variants run and what it remembers: DVC's ``dvc exp run --temp``, the state file, the outputs.

Each variant is ``dvc exp run --temp --name <name> --set-param ...`` started in the checkout: DVC runs it in a
temporary workspace under ``.dvc/tmp/exps`` that shares the checkout's cache and run cache
(``TempDirExecutor`` in dvc/repo/experiments/executor/local.py) and keeps it as an experiment of the checkout
(``dvc exp show``). The environment of the command reaches the stages, so each variant names its own MLflow parent;
the stages no variant changes come back from the run cache; what the sweep reads afterwards (details files,
test hypotheses) it reads from the experiment's commit through DVC's cache (``dvc.api.read``).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flows.lifeline import ProcessResult
from flows.sweep_spec import SpecError, SweepSpec
from pipeline.core.config import flatten
from pipeline.core.errors import PipelineError
from pipeline.core.owned import write_text

SWEEPS_DIR = Path(".dvc") / "tmp" / "sweeps"
REPORTS_DIR = Path("reports") / "sweeps"


class VariantFailed(PipelineError):
    """A command of one variant failed; ``summary`` is one line: the failed stage's error line, else DVC's last."""

    def __init__(self, name: str, result: ProcessResult) -> None:
        tail = "\n".join(result.stderr_tail[-8:]) or "(no stderr)"
        lines = [line.strip() for line in result.stderr_tail] or ["(no stderr)"]
        cause = next((line for line in reversed(lines) if line.startswith("error: stage ")), lines[-1])
        self.summary = (f"variant {name}: {cause} (`{' '.join(result.args)}` failed with exit code "
                        f"{result.returncode} after {result.duration_s:.0f} s)")
        super().__init__(f"{self.summary}; last lines of stderr:\n{tail}")


def sweep_dir(root: Path, name: str) -> Path:
    """``<root>/.dvc/tmp/sweeps/<name>``: the sweep's state file, lock and each variant's record folder."""
    return root / SWEEPS_DIR / name


def _run(cwd: Path, *cmd: str) -> str:
    """Run ``cmd`` in ``cwd``; its stripped stdout (a PipelineError naming the command and its stderr if it fails)."""
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PipelineError(f"{cwd}: `{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout.strip()


def head_commit(root: Path) -> str:
    """The commit the checkout is at (a sweep runs committed code only; PipelineError when there is none)."""
    try:
        return _run(root, "git", "rev-parse", "--verify", "HEAD^{commit}")
    except PipelineError:
        raise PipelineError(f"{root}: a sweep runs the committed pipeline, and this checkout has no commit; "
                            "commit it first (git add -A && git commit)") from None


def read_at(root: Path, rev: str, path: str) -> str:
    """The text of ``path`` (git-tracked or a DVC output) as experiment commit ``rev`` of ``root`` has it.

    Raises:
        FileNotFoundError: the experiment has no such file.
    """
    import dvc.api
    from dvc.exceptions import PathMissingError

    try:
        return dvc.api.read(path, repo=str(root), rev=rev, encoding="utf-8")
    except PathMissingError as exc:
        raise FileNotFoundError(f"experiment {rev[:7]} has no {path}") from exc


def overrides(root: Path, params: dict[str, Any], applied: dict[str, Any]) -> dict[str, Any]:
    """The ``--set-param`` overrides that turn the checkout's params.yaml into ``params``: the variant's ``applied``
    first, then every other key the sweep's profile sets otherwise (none when the checkout holds that profile)."""
    workspace = flatten(yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8")) or {})
    wanted = flatten(params)
    return {**{k: wanted[k] for k in applied}, **{k: v for k, v in wanted.items() if workspace.get(k) != v}}


def check_applied(root: Path, rev: str, params: dict[str, Any]) -> None:
    """Raise a PipelineError unless ``dvc exp run --set-param`` left params.yaml as the variant's ``params``."""
    got = flatten(yaml.safe_load(_run(root, "git", "show", f"{rev}:params.yaml")) or {})
    for key, value in flatten(params).items():
        if got.get(key) != value:
            raise PipelineError(f"params.yaml of experiment {rev[:7]}: `dvc exp run --set-param` left "
                                f"{key}={got.get(key)!r}, not {value!r} as the spec says; quote the value in the spec")


def set_param(key: str, value: Any) -> str:
    """``key=value`` for ``dvc exp run --set-param`` (Hydra's override grammar reads JSON scalars and lists)."""
    return f"{key}={json.dumps(value, separators=(',', ':'))}"


def exp_run_command(name: str, applied: dict[str, Any], *targets: str) -> list[str]:
    """``dvc exp run --temp --name NAME --set-param k=v ... [TARGETS]``."""
    return ["dvc", "exp", "run", "--temp", "--name", name,
            *(a for k, v in applied.items() for a in ("--set-param", set_param(k, v))), *targets]


def exp_ref(root: Path, name: str, commit: str) -> str | None:
    """The sha of experiment ``name`` on baseline ``commit`` in ``root`` (DVC's ``refs/exps/<2>/<38>/<name>``)."""
    ref = f"refs/exps/{commit[:2]}/{commit[2:]}/{name}"
    return _run(root, "git", "for-each-ref", "--format=%(objectname)", ref) or None


def remove_exp(root: Path, name: str, commit: str) -> None:
    """``dvc exp remove NAME`` when the sweep's experiment ``name`` exists (an interrupted try's, or the shared one)."""
    if exp_ref(root, name, commit):
        _run(root, "dvc", "exp", "remove", name)


def _params_entries(entries: Iterable[Any]) -> Iterator[str | None]:
    """The params keys a dvc.yaml stage depends on (None: all of a file)."""
    for entry in entries:
        if isinstance(entry, str):
            yield entry
        elif isinstance(entry, dict):
            for keys in entry.values():
                yield from (keys if isinstance(keys, list) else [None])


def _touches(param: str | None, key: str) -> bool:
    return param is None or param == key or key.startswith(f"{param}.") or param.startswith(f"{key}.")


def shared_stages(dvc_yaml: Path, keys: Iterable[str]) -> list[str]:
    """The leading stages of ``dvc_yaml`` no key of ``keys`` touches, up to train (its checkpoints are no DVC output,
    so a variant cannot share them) or the first uncached ``persist`` output."""
    stages = (yaml.safe_load(dvc_yaml.read_text(encoding="utf-8")) or {}).get("stages") or {}
    keys = list(keys)
    shared = []
    for name, stage in stages.items():
        params = list(_params_entries(stage.get("params") or []))
        persists = any(isinstance(o, dict) and o.get("persist") and o.get("cache") is False
                       for out in stage.get("outs") or [] if isinstance(out, dict) for o in out.values())
        if name == "train" or persists or any(_touches(p, k) for p in params for k in keys):
            break
        shared.append(name)
    return shared


class VariantRecord(BaseModel):
    """One variant's outcome, as the state file keeps it and the report reads it."""

    model_config = ConfigDict(extra="forbid")

    name: str
    index: int
    overrides: dict[str, Any]  # its own dotted params overrides (the spec's values)
    status: Literal["done", "failed", "not run"]
    metrics: dict[str, float] = Field(default_factory=dict)  # flows/report.py headline_metrics
    mlflow_run_id: str | None = None
    exp_rev: str = ""  # the DVC experiment's commit
    stages: dict[str, str] = Field(default_factory=dict)  # stage -> ran, restored, skipped or unknown
    duration_s: float | None = None
    error: str | None = None  # a failed variant's one-line cause


class Plan(BaseModel):
    """What a state file was written for: the base profile and the variants' keys (:attr:`Variant.key`)."""

    model_config = ConfigDict(extra="forbid")

    profile: str
    variants: list[str]


class StateFile(BaseModel):
    """``<sweep dir>/state.json``."""

    model_config = ConfigDict(extra="forbid")

    name: str
    commit: str  # the commit the sweep started at
    plan: Plan
    mlflow_run_id: str | None = None  # the MLflow parent's, once created
    variants: dict[str, VariantRecord] = Field(default_factory=dict)  # by variant key, in the order they ended


class SweepState:
    """The state file ``<sweep dir>/state.json``: the commit, the MLflow parent and each finished variant."""

    def __init__(self, path: Path, data: StateFile) -> None:
        self.path, self.data = path, data

    @classmethod
    def load(cls, root: Path, spec: SweepSpec, commit: str) -> SweepState:
        """The sweep's state, or a new one at ``commit``; a SpecError when written for other variants or base, or
        unreadable."""
        path = sweep_dir(root, spec.name) / "state.json"
        plan = Plan(profile=spec.profile, variants=[v.key for v in spec.variants])
        if not path.is_file():
            return cls(path, StateFile(name=spec.name, commit=commit, plan=plan))
        start_over = f"give this spec another name, or delete {path.parent} to start it over"
        try:
            data = StateFile.model_validate_json(path.read_bytes())
        except ValidationError as exc:
            raise SpecError(spec.source, f"{path}: not a sweep state file ({exc.errors()[0]['msg']}); "
                                         f"{start_over}") from None
        if data.plan != plan:
            raise SpecError(spec.source, f"sweep {spec.name!r} already ran with another profile or other variants "
                                         f"({path}); {start_over}")
        return cls(path, data)

    def done(self, key: str) -> VariantRecord | None:
        """The record of a finished variant, or None."""
        record = self.data.variants.get(key)
        return record if record and record.status == "done" else None

    def save(self) -> None:
        """Write the state file (atomically: a killed run leaves the previous one)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text(self.path, self.data.model_dump_json(indent=2) + "\n")
