"""Every ``NMT_*`` environment variable the project reads, in one typed table (:class:`Settings`): machine settings
live here, never in params.yaml, so moving machines never invalidates a DVC stage. Unset or blank: the default."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class Parser:
    """How a variable's text becomes its value (``fn``: a ``ValueError`` argument per problem); ``kind`` in words."""

    kind: str
    fn: Callable[[str], Any]


def integer(minimum: int, maximum: int | None = None) -> Parser:
    kind = f"integer >= {minimum}" if maximum is None else f"integer from {minimum} to {maximum}"

    def parse(raw: str) -> int:
        digits = raw.lstrip("+-")
        value = int(raw) if re.fullmatch(r"[+-]?[0-9]+", raw) and len(digits) <= 30 else minimum - 1
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"expected an {kind}")
        return value
    return Parser(kind, parse)


def seconds(*, positive: bool, maximum: float | None = None) -> Parser:
    bound = ("> 0" if positive else ">= 0") + ("" if maximum is None else f" and <= {maximum:g}")

    def parse(raw: str) -> float:
        with contextlib.suppress(ValueError):
            if (math.isfinite(value := float(raw)) and (value > 0 if positive else value >= 0)
                    and (maximum is None or value <= maximum)):
                return value
        raise ValueError(f"expected a number of seconds {bound}")
    return Parser(f"seconds {bound}", parse)


def _switch(raw: str) -> bool:
    if (word := raw.lower()) in SWITCH_ON or word in TRACKING_OFF:
        return word in SWITCH_ON
    raise ValueError(f"expected on/off: one of {', '.join(SWITCH_ON)} or {', '.join(TRACKING_OFF)}")


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


def choice(*choices: str) -> Parser:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return raw
    return Parser(" or ".join(f"`{c}`" for c in choices), parse)


def _fault(raw: str) -> Fault:
    """Parse :data:`FAULT_SYNTAX`, reporting every problem of the spec."""
    spec, at, once = raw.partition("@")  # the file may hold ':' and '@'; the spec before it holds neither '@'
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
        raise ValueError(*problems)
    return Fault(point=parts[0], step=int(parts[1]), action=parts[2] if len(parts) > 2 else "kill",
                 rank=int(parts[3]) if len(parts) > 3 else None, once=Path(once.strip()) if at else None)


TEXT = Parser("text", str)
PATH = Parser("path", Path)
MIRROR = Parser("folder or http(s) URL", lambda raw: raw.removeprefix("file://"))
SWITCH = Parser("on/off", _switch)
MODEL_NAME = Parser(f"name of at most {MAX_MODEL_NAME_CHARS} printable characters, no `/` or `:`", _model_name)
LEVEL = Parser("logging level", str.upper)
FAULT_SPEC = Parser(f"`{FAULT_SYNTAX}`", _fault)


def meta(name: str, parse: Parser, doc: str) -> dict[str, str | Parser]:
    """A :class:`Settings` field's metadata: its variable, its parser, one line of documentation."""
    return {"env": name, "parse": parse, "doc": doc}


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every ``NMT_*`` variable, parsed. A field's default is the value when its variable is unset or blank."""

    # Launch (pipeline/launch.py): torchrun's command line.
    nproc: int | None = field(default=None, metadata=meta(
        "NMT_NPROC", integer(1), "training processes on this node (torchrun `--nproc_per_node`; default: the CUDA "
        "GPUs, else 1)"))
    nnodes: int = field(default=1, metadata=meta(
        "NMT_NNODES", integer(1), "number of nodes; > 1 switches to a multi-node torchrun job"))
    rdzv_endpoint: str | None = field(default=None, metadata=meta(
        "NMT_RDZV_ENDPOINT", TEXT, "`host:port` where the nodes meet: a c10d rendezvous, or with NMT_NODE_RANK "
        "node 0 (static; port 29500 if none)"))
    node_rank: int | None = field(default=None, metadata=meta(
        "NMT_NODE_RANK", integer(0), "this node's rank, 0 .. NMT_NNODES-1, for a static rendezvous; unset: the c10d "
        "one assigns them"))
    rdzv_id: str = field(default="nmt-train", metadata=meta(
        "NMT_RDZV_ID", TEXT, "job id shared by the nodes of a c10d rendezvous"))
    rdzv_timeout_s: int = field(default=600, metadata=meta(
        "NMT_RDZV_TIMEOUT_S", integer(1, MAX_WAIT_S), "seconds a node waits at the rendezvous in every mode (start, "
        "restart): for its host, the others, a store that answers"))
    max_restarts: int | None = field(default=None, metadata=meta(
        "NMT_MAX_RESTARTS", integer(0), "how often torchrun restarts the worker group after a rank fails, "
        "resuming from the newest checkpoint (default 3 on GPU jobs, else 0)"))
    # Training (pipeline/train.py, pipeline/training/).
    device: str | None = field(default=None, metadata=meta(
        "NMT_DEVICE", choice("cpu", "cuda"), "training device (default CUDA when available); `cpu` forces CPU (and "
        "no restarts by default)"))
    threads: int | None = field(default=None, metadata=meta(
        "NMT_THREADS", integer(1), "torch CPU threads per training process (default: torch's)"))
    max_tokens: int | None = field(default=None, metadata=meta(
        "NMT_MAX_TOKENS", integer(1), "padded tokens per forward pass of a training process (memory, not results; "
        "default 8192 on CUDA, 4096 on CPU)"))
    deterministic: bool = field(default=False, metadata=meta(
        "NMT_DETERMINISTIC", SWITCH, "deterministic CUDA kernels (`torch.use_deterministic_algorithms`): GPU runs "
        "and resumes bitwise equal"))
    compile: bool = field(default=False, metadata=meta(
        "NMT_COMPILE", SWITCH, "`torch.compile` the training forward pass and loss (dynamic shapes): faster GPU "
        "steps after minutes of compiling"))
    dist_timeout_s: float = field(default=1800.0, metadata=meta(
        "NMT_DIST_TIMEOUT_S", seconds(positive=True, maximum=MAX_WAIT_S), "collective timeout: a rank that waits "
        "longer for its peers fails, naming this variable"))
    # Fault injection (pipeline/training/faults.py): test hooks, unset in normal runs.
    fault: Fault | None = field(default=None, metadata=meta(
        "NMT_FAULT_POINT", FAULT_SPEC, "test hook: kill, crash or stall training at a named point; with `@<file>` "
        "only once (pipeline/training/faults.py)"))
    # Data (pipeline/download.py, pipeline/clean.py, pipeline/encode.py).
    data_mirror: str | None = field(default=None, metadata=meta(
        "NMT_DATA_MIRROR", MIRROR, "replaces the upstream URLs (a file it lacks is an error; `user:password@` is "
        "sent as basic auth); unset: `../shared/data` if present"))
    download_cache: Path = field(default=DEFAULT_DOWNLOAD_CACHE, metadata=meta(
        "NMT_DOWNLOAD_CACHE", PATH, "cache of upstream downloads (default `<repo>/.cache/downloads`)"))
    download_backoff_s: float = field(default=1.0, metadata=meta(
        "NMT_DOWNLOAD_BACKOFF_S", seconds(positive=False), "first retry delay of a failed download (doubling)"))
    data_workers: int | None = field(default=None, metadata=meta(
        "NMT_DATA_WORKERS", integer(1), "worker processes of the clean and encode stages (1: none, the stage's own "
        "process does the work; default `os.cpu_count()`)"))
    # Tracking and logging (pipeline/core/, pipeline/register.py).
    tracking: bool = field(default=True, metadata=meta(
        "NMT_TRACKING", SWITCH, "MLflow tracking; `off`, `0`, `false` or `no` turns every tracking call into "
        "a no-op (`on`, `1`, `true`, `yes`: on)"))
    log_level: str = field(default="INFO", metadata=meta(
        "NMT_LOG_LEVEL", LEVEL, "logging level of every stage (an unknown name means INFO)"))
    model_name: str | None = field(default=None, metadata=meta(
        "NMT_MODEL_NAME", MODEL_NAME, "registered MLflow model (stage register); default `wmt14-transformer` for "
        "profile paper, else `<profile>-transformer`"))
    register_ctranslate2: str = field(default="off", metadata=meta(
        "NMT_REGISTER_CTRANSLATE2", choice("off", "float32", "int8", "int8_float32", "float16"),
        "stage register ships a CTranslate2 export of this weight type in the MLflow translator (its default engine)"))
    prefect_flow_run_id: str | None = field(default=None, metadata=meta(
        "NMT_PREFECT_FLOW_RUN_ID", TEXT, "set by the Prefect flow for its stages: tags each stage's MLflow run "
        "with the flow run"))
    profile_run: str | None = field(default=None, metadata=meta(
        "NMT_PROFILE_RUN", TEXT, "set by the Prefect flow during a `--profile` run: stage runs tag the profile, "
        "params.yaml is left out of `git_dirty`"))


#: ``NMT_MAX_TOKENS`` when unset: fixed per device type, never derived from free memory.
DEFAULT_MAX_TOKENS: dict[str, int] = {"cuda": 8192, "cpu": 4096}


def max_tokens(device_type: str) -> int:
    """The per-forward token budget on ``device_type`` (``cuda``/``cpu``): ``NMT_MAX_TOKENS`` or the default."""
    return settings().max_tokens or DEFAULT_MAX_TOKENS.get(device_type, DEFAULT_MAX_TOKENS["cpu"])


FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(Settings)
NAMES: tuple[str, ...] = tuple(f.metadata["env"] for f in FIELDS)

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
    raw_values = dict(snapshot)
    values: dict[str, Any] = {}
    problems: list[str] = []
    for f in FIELDS:
        name = f.metadata["env"]
        if not (raw := raw_values.get(name, "").strip()):
            continue
        try:
            values[f.name] = f.metadata["parse"].fn(raw)
        except ValueError as exc:
            problems.extend(f"{name}={_clip(raw)!r}: {problem}" for problem in exc.args)
    for name, replacement in RETIRED.items():
        if raw_values.get(name, "").strip():
            problems.append(f"{name}={raw_values[name].strip()!r}: no longer read; {replacement}")
    if problems:
        raise ConfigError(SOURCE, problems)
    return Settings(**values)


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

    Raises:
        ConfigError: an ``NMT_*`` variable of ``environ`` (default ``os.environ``) is malformed.
    """
    environ = os.environ if environ is None else environ
    if chosen := settings(environ).data_mirror:
        return MirrorChoice(chosen, "set by NMT_DATA_MIRROR")
    if "NMT_DATA_MIRROR" in environ:
        return MirrorChoice(None, "NMT_DATA_MIRROR is set but empty")
    beside = (Path(root).resolve() / SHARED_DATA).resolve()
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
