"""Every ``NMT_*`` environment variable the project reads, in one pydantic model (:class:`Settings`): machine
settings live here, never in params.yaml, so moving machines never invalidates a DVC stage. Unset or blank: the
default. Each field's alias is its variable, its type and bounds the check, its description the one line that
docs/configuration.md shows (tests/pipeline/core/test_env.py holds the two together).

A plain pydantic model validated from a snapshot of the environment rather than pydantic-settings' ``BaseSettings``:
the stages and tests validate a given mapping (a child's environment), which ``BaseSettings`` reads only from
``os.environ``."""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from pipeline.core.errors import ConfigError

SOURCE = "environment"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DOWNLOAD_CACHE = REPO_ROOT / ".cache" / "downloads"
TRACKING_OFF = ("off", "0", "false", "no")
SWITCH_ON = ("on", "1", "true", "yes")
#: The longest wait any ``*_TIMEOUT_S`` variable may ask for (a week): ``threading.Timer`` and torch's C++
#: timeouts overflow on values such as 1e20, which no run needs.
MAX_WAIT_S = 7 * 24 * 3600
#: The longest ``NMT_MODEL_NAME``: MLflow stores a registered model's name in a VARCHAR(256) column.
MAX_MODEL_NAME_CHARS = 256
FAULT_POINTS = ("preflight", "forward", "mid_accum", "collective", "before_save", "mid_save", "after_save",
                "after_step")
FAULT_ACTIONS = ("kill", "exit", "stall", "oom")
FAULT_SYNTAX = "<point>:<step>[:<action>[:<rank>]][@<file>]"


@dataclass(frozen=True)
class Fault:
    """One parsed ``NMT_FAULT_POINT`` (:mod:`pipeline.training.faults`); ``once``: fire only while it is absent."""

    point: str
    step: int
    action: str = "kill"
    rank: int | None = None
    once: Path | None = None


def _switch(raw: Any) -> Any:
    if isinstance(raw, str) and ((word := raw.lower()) in SWITCH_ON or word in TRACKING_OFF):
        return word in SWITCH_ON
    raise ValueError(f"expected on/off: one of {', '.join(SWITCH_ON)} or {', '.join(TRACKING_OFF)}")


def _digits(raw: Any) -> Any:
    """Only plain decimal digits make an integer (pydantic would also take ``2_0`` and ``1.0``), at most 30."""
    if isinstance(raw, str) and not re.fullmatch(r"[+-]?[0-9]{1,30}", raw):
        raise ValueError("expected a whole number of at most 30 digits")
    return raw


def _model_name(raw: str) -> str:
    """MLflow's rules for a registered model's name (``_validate_model_name`` in mlflow/utils/validation.py: no
    '/' or ':', and not a path that normalises to another name), plus printable and at most 256 characters."""
    if len(raw) > MAX_MODEL_NAME_CHARS:
        raise ValueError(f"{len(raw)} characters, more than {MAX_MODEL_NAME_CHARS}; choose a shorter name")
    if not raw.isprintable():
        raise ValueError("holds a control character (a newline, a tab...); choose a name of printable characters")
    if "/" in raw or ":" in raw or raw.startswith(".."):
        raise ValueError("MLflow refuses a registered model name with '/' or ':' or starting with '..'; "
                         "choose another name")
    return raw


def _fault(raw: Any) -> Fault:
    """Parse :data:`FAULT_SYNTAX`, reporting every problem of the spec."""
    spec, at, once = str(raw).partition("@")  # the file may hold ':' and '@'; the spec before it holds neither '@'
    parts = spec.split(":")
    if not 2 <= len(parts) <= 4:
        raise ValueError(f"expected {FAULT_SYNTAX}")
    problems = []
    if at and not once.strip():
        problems.append("no file after '@'")
    if parts[0] not in FAULT_POINTS:
        problems.append(f"unknown point {parts[0]!r}; one of {', '.join(FAULT_POINTS)}")
    if len(parts) > 2 and parts[2] not in FAULT_ACTIONS:
        problems.append(f"unknown action {parts[2]!r}; one of {', '.join(FAULT_ACTIONS)}")
    for label, value in (("step", parts[1]), ("rank", parts[3] if len(parts) > 3 else "0")):
        if not re.fullmatch(r"[0-9]+", value):
            problems.append(f"{label} {value!r} is not a non-negative integer")
    if problems:
        raise ValueError("; ".join(problems))
    return Fault(point=parts[0], step=int(parts[1]), action=parts[2] if len(parts) > 2 else "kill",
                 rank=int(parts[3]) if len(parts) > 3 else None, once=Path(once.strip()) if at else None)


Count = Annotated[int, BeforeValidator(_digits), Field(ge=1)]
Switch = Annotated[bool, BeforeValidator(_switch)]
Wait = Annotated[float, Field(gt=0, le=MAX_WAIT_S, allow_inf_nan=False)]
Level = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                  BeforeValidator(lambda raw: str(raw).upper())]


def _var(name: str, doc: str, **bounds: Any) -> Any:
    """A :class:`Settings` field read from variable ``name``, documented by ``doc`` (one line)."""
    return Field(validation_alias=name, description=doc, **bounds)


class Settings(BaseModel):
    """Every ``NMT_*`` variable, parsed. A field's default is the value when its variable is unset or blank."""

    model_config = ConfigDict(frozen=True, extra="ignore", arbitrary_types_allowed=True, populate_by_name=True)

    # Launch (pipeline/launch.py): torchrun's command line.
    nproc: Count | None = _var(
        "NMT_NPROC", "training processes on this node (torchrun `--nproc_per_node`; default: the CUDA GPUs, else 1)",
        default=None)
    nnodes: Count = _var("NMT_NNODES", "number of nodes; > 1 switches to a multi-node torchrun job", default=1)
    rdzv_endpoint: str | None = _var(
        "NMT_RDZV_ENDPOINT", "`host:port` where the nodes meet: a c10d rendezvous, or with NMT_NODE_RANK node 0 "
        "(static; port 29500 if none)", default=None)
    node_rank: Annotated[int, BeforeValidator(_digits), Field(ge=0)] | None = _var(
        "NMT_NODE_RANK", "this node's rank, 0 .. NMT_NNODES-1, for a static rendezvous; unset: the c10d one assigns "
        "them", default=None)
    rdzv_id: str = _var("NMT_RDZV_ID", "job id shared by the nodes of a c10d rendezvous", default="nmt-train")
    rdzv_timeout_s: Annotated[int, BeforeValidator(_digits), Field(ge=1, le=MAX_WAIT_S)] = _var(
        "NMT_RDZV_TIMEOUT_S", "seconds a node waits at the rendezvous in every mode (start, restart): for its host, "
        "the others, a store that answers", default=600)
    max_restarts: Annotated[int, BeforeValidator(_digits), Field(ge=0)] | None = _var(
        "NMT_MAX_RESTARTS", "how often torchrun restarts the worker group after a rank fails, resuming from the "
        "newest checkpoint (default 3 on GPU jobs, else 0)", default=None)
    # Training (pipeline/train.py, pipeline/training/).
    device: Literal["cpu", "cuda"] | None = _var(
        "NMT_DEVICE", "training device (default CUDA when available); `cpu` forces CPU (and no restarts by default)",
        default=None)
    threads: Count | None = _var("NMT_THREADS", "torch CPU threads per training process (default: torch's)",
                                 default=None)
    max_tokens: Count | None = _var(
        "NMT_MAX_TOKENS", "padded tokens per forward pass of a training process (memory, not results; default 8192 "
        "on CUDA, 4096 on CPU)", default=None)
    deterministic: Switch = _var(
        "NMT_DETERMINISTIC", "deterministic CUDA kernels (`torch.use_deterministic_algorithms`): GPU runs and "
        "resumes bitwise equal", default=False)
    compile: Switch = _var(
        "NMT_COMPILE", "`torch.compile` the training forward pass and loss (dynamic shapes): faster GPU steps after "
        "minutes of compiling", default=False)
    dist_timeout_s: Wait = _var(
        "NMT_DIST_TIMEOUT_S", "collective timeout: a rank that waits longer for its peers fails, naming this "
        "variable", default=1800.0)
    # Fault injection (pipeline/training/faults.py): test hooks, unset in normal runs.
    fault: Annotated[Fault, BeforeValidator(_fault)] | None = _var(
        "NMT_FAULT_POINT", "test hook: kill, crash or stall training at a named point; with `@<file>` only once "
        "(pipeline/training/faults.py)", default=None)
    # Data (pipeline/download.py, pipeline/clean.py, pipeline/encode.py).
    data_mirror: Annotated[str, AfterValidator(lambda raw: raw.removeprefix("file://"))] | None = _var(
        "NMT_DATA_MIRROR", "replaces the upstream URLs (a file it lacks is an error; `user:password@` is sent as "
        "basic auth); unset: `../shared/data` if present", default=None)
    download_cache: Path = _var("NMT_DOWNLOAD_CACHE", "cache of upstream downloads (default `<repo>/.cache/downloads`)",
                                default=DEFAULT_DOWNLOAD_CACHE)
    download_backoff_s: Annotated[float, Field(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)] = _var(
        "NMT_DOWNLOAD_BACKOFF_S", "backoff factor of a failed download's retries (urllib3 `Retry`: the first at "
        "once, the n-th after factor × 2^(n-1) s, at most 60 s)", default=1.0)
    data_workers: Count | None = _var(
        "NMT_DATA_WORKERS", "worker processes of the clean and encode stages (1: none, the stage's own process does "
        "the work; default `os.cpu_count()`)", default=None)
    # Tracking and logging (pipeline/core/, pipeline/register.py).
    tracking: Switch = _var(
        "NMT_TRACKING", "MLflow tracking; `off`, `0`, `false` or `no` turns every tracking call into a no-op (`on`, "
        "`1`, `true`, `yes`: on)", default=True)
    log_level: Level = _var("NMT_LOG_LEVEL", "logging level of every stage: DEBUG, INFO, WARNING, ERROR or CRITICAL",
                            default="INFO")
    model_name: Annotated[str, AfterValidator(_model_name)] | None = _var(
        "NMT_MODEL_NAME", "registered MLflow model (stage register); default `wmt14-transformer` for profile paper, "
        "else `<profile>-transformer`", default=None)
    register_ctranslate2: Literal["off", "float32", "int8", "int8_float32", "float16"] = _var(
        "NMT_REGISTER_CTRANSLATE2", "stage register ships a CTranslate2 export of this weight type in the MLflow "
        "translator (its default engine)", default="off")
    prefect_flow_run_id: str | None = _var(
        "NMT_PREFECT_FLOW_RUN_ID", "set by the Prefect flow for its stages: tags each stage's MLflow run with the "
        "flow run", default=None)
    profile_run: str | None = _var(
        "NMT_PROFILE_RUN", "set by the Prefect flow during a `--profile` run: stage runs tag the profile, params.yaml "
        "is left out of `git_dirty`", default=None)


#: ``NMT_MAX_TOKENS`` when unset: fixed per device type, never derived from free memory.
DEFAULT_MAX_TOKENS: dict[str, int] = {"cuda": 8192, "cpu": 4096}


def max_tokens(device_type: str) -> int:
    """The per-forward token budget on ``device_type`` (``cuda``/``cpu``): ``NMT_MAX_TOKENS`` or the default."""
    return settings().max_tokens or DEFAULT_MAX_TOKENS.get(device_type, DEFAULT_MAX_TOKENS["cpu"])


#: Each field's variable, in the table's order.
NAMES: tuple[str, ...] = tuple(str(f.validation_alias) for f in Settings.model_fields.values())

#: Variables no longer read: setting one is an error naming its replacement, never silently ignored.
RETIRED: dict[str, str] = {
    "NMT_CLEAN_WORKERS": "set NMT_DATA_WORKERS (worker processes of clean and encode) instead",
    "NMT_ENCODE_WORKERS": "set NMT_DATA_WORKERS (worker processes of clean and encode) instead",
    "NMT_FAULT_ONCE": "append @<file> to NMT_FAULT_POINT instead",
    "NMT_FAULT_KILL_AT_STEP": "set NMT_FAULT_POINT=after_step:<N> instead",
    "NMT_DIST_BACKEND": "the backend follows NMT_DEVICE (nccl on cuda, gloo on cpu)",
    "NMT_MASTER_ADDR": "set NMT_RDZV_ENDPOINT=<node 0>:<port> with NMT_NODE_RANK (static rendezvous) instead",
    "NMT_MASTER_PORT": "set NMT_RDZV_ENDPOINT=<node 0>:<port> with NMT_NODE_RANK (static rendezvous) instead",
}


def _snapshot(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((name, environ[name]) for name in (*NAMES, *RETIRED) if name in environ)


@functools.lru_cache(maxsize=32)
def _parse(snapshot: tuple[tuple[str, str], ...]) -> Settings:
    raw_values = {name: raw.strip() for name, raw in snapshot if raw.strip()}
    problems: list[str] = []
    try:
        parsed = Settings.model_validate({name: raw for name, raw in raw_values.items() if name in NAMES})
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            name = str(error["loc"][0])
            message = error["msg"].removeprefix("Value error, ")
            problems.append(f"{name}={_clip(raw_values[name])!r}: {message}")
    problems += [f"{name}={raw_values[name]!r}: no longer read; {replacement}" for name, replacement in RETIRED.items()
                 if name in raw_values]
    if problems:
        raise ConfigError(SOURCE, problems)
    return parsed


def _clip(raw: str, limit: int = 80) -> str:
    """``raw`` as an error line quotes it: at most ``limit`` characters."""
    return raw if len(raw) <= limit else raw[:limit - 3] + "..."


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Every ``NMT_*`` variable of ``environ`` (default ``os.environ``), parsed; a ConfigError line per bad one."""
    return _parse(_snapshot(os.environ if environ is None else environ))


settings.cache_clear = _parse.cache_clear  # type: ignore[attr-defined]


#: Where an offline machine keeps its copy of the data, relative to the checkout (used when NMT_DATA_MIRROR is unset).
SHARED_DATA = Path("..", "shared", "data")


@dataclass(frozen=True)
class MirrorChoice:
    """The download stage's mirror and why it was chosen (the stage logs both once)."""

    location: str | None  # a folder or an http(s) URL (userinfo included); None: the upstream URLs
    reason: str


def data_mirror(root: Path, environ: Mapping[str, str] | None = None) -> MirrorChoice:
    """The mirror for the checkout ``root``: ``NMT_DATA_MIRROR`` when set (set but blank: none), else the folder
    :data:`SHARED_DATA` beside the checkout when it exists, else none. The one place this rule lives: ``make``,
    ``nmt run``, the flow and ``dvc repro`` all run the download stage in the checkout, so all find the same mirror.
    A queued or ``--temp`` experiment runs its stages in a folder under ``.dvc/tmp/exps`` and DVC sets ``DVC_ROOT``
    to the repository it was queued from (``run_env`` in dvc/repo/experiments/queue/base.py); the folder beside
    that repository is the one looked for.

    Raises:
        ConfigError: an ``NMT_*`` variable of ``environ`` (default ``os.environ``) is malformed.
    """
    environ = os.environ if environ is None else environ
    if chosen := settings(environ).data_mirror:
        return MirrorChoice(chosen, "set by NMT_DATA_MIRROR")
    if "NMT_DATA_MIRROR" in environ:
        return MirrorChoice(None, "NMT_DATA_MIRROR is set but empty")
    checkout = Path(environ.get("DVC_ROOT") or root).resolve()
    beside = (checkout / SHARED_DATA).resolve()
    if beside.is_dir():
        return MirrorChoice(str(beside), "found beside the checkout, as NMT_DATA_MIRROR is unset")
    return MirrorChoice(None, f"NMT_DATA_MIRROR is unset and there is no {beside}")


def prefer_this_interpreter() -> None:
    """Put this interpreter's folder first on ``PATH``, so the ``dvc`` the flows start is this environment's."""
    folder = str(Path(sys.executable).parent)
    parts = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    if parts[:1] != [folder]:
        os.environ["PATH"] = os.pathsep.join([folder, *(p for p in parts if p != folder)])


def model_name(profile: str) -> str:
    """The registered MLflow model of ``profile``'s runs: ``NMT_MODEL_NAME``, else one name per profile, so that a
    smoke run of the tiny profile never becomes a version of the paper's model."""
    return settings().model_name or ("wmt14-transformer" if profile == "paper" else f"{profile}-transformer")
