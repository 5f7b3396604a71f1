"""params.yaml → one tree of frozen, keyword-only dataclasses.

Every unknown, missing or mistyped key is collected and reported together in one
:class:`ConfigError` that names each key by its dotted path. Cross-field rules live in
``__post_init__`` of the section they concern (they run only once the types are right).
Derived values (vocabulary size, forward passes per step) are computed elsewhere, never stored. The
``model`` section validates into the network's own :class:`model.config.TransformerConfig` (its
derived fields, the vocabulary size and special ids, are not params).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from model.config import DERIVED, TransformerConfig
from pipeline.core.errors import ConfigError

DATASETS = ("wmt14", "multi30k")
#: Keys that left params.yaml for an ``NMT_*`` variable (pipeline/core/env.py): a params file that
#: still has one fails naming the variable.
MOVED_TO_ENV = {"train.max_tokens": "NMT_MAX_TOKENS"}


@dataclass(frozen=True, kw_only=True)
class PathsConfig:
    """Where each stage reads and writes; dvc.yaml templates its paths from here."""

    raw: str
    clean: str
    bpe: str
    shards: str
    train: str
    model: str
    eval: str
    metrics: str
    plots: str
    reports: str


@dataclass(frozen=True, kw_only=True)
class DownloadConfig:
    """Stage ``download``: which dataset, how hard to try, which checksums to enforce."""

    dataset: Literal["wmt14", "multi30k"]
    retries: int = 5
    timeout_s: float = 60.0
    # Expected sha256 per upstream file name (archive or member); empty = record on first download.
    sha256: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError("download.retries must be >= 0")
        if self.timeout_s <= 0:
            raise ValueError("download.timeout_s must be > 0")


@dataclass(frozen=True, kw_only=True)
class CleanConfig:
    """Stage ``clean``: training-pair filters (valid/test pass through complete)."""

    max_words: int = 250
    max_ratio: float = 1.5
    min_words: int = 1
    dedup: bool = True
    drop_copies: bool = True

    def __post_init__(self) -> None:
        if self.min_words < 1 or self.max_words < self.min_words:
            raise ValueError("clean: need 1 <= min_words <= max_words")
        if self.max_ratio < 1.0:
            raise ValueError("clean.max_ratio must be >= 1.0 (it compares the longer side to the shorter)")


@dataclass(frozen=True, kw_only=True)
class BpeConfig:
    """Stage ``bpe``: joint SentencePiece BPE over both languages."""

    vocab_size: int = 37000
    input_sentence_size: int = 10_000_000
    character_coverage: float = 1.0
    seed: int = 1

    def __post_init__(self) -> None:
        if self.vocab_size < 8:
            raise ValueError("bpe.vocab_size must be >= 8 (4 special ids + pieces)")
        if not 0.0 < self.character_coverage <= 1.0:
            raise ValueError("bpe.character_coverage must be in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class EncodeConfig:
    """Stage ``encode``: BPE ids into Parquet shards."""

    max_len: int = 256
    shard_rows: int = 250_000

    def __post_init__(self) -> None:
        if self.max_len < 1 or self.shard_rows < 1:
            raise ValueError("encode.max_len and encode.shard_rows must be >= 1")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Stage ``train``: batching, optimiser, schedule, stopping, checkpoints."""

    tokens_per_step: int = 25000
    lr_scale: float = 1.0
    warmup_steps: int = 4000
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float = 0.0
    max_steps: int = 100_000
    max_epochs: int = 0
    max_minutes: float = 0.0
    save_every_steps: int = 1000
    keep_last: int = 5
    valid_every_steps: int = 1000
    log_every_steps: int = 100

    def __post_init__(self) -> None:
        if self.tokens_per_step < 1:
            raise ValueError("train.tokens_per_step must be >= 1")
        if self.max_steps < 1:
            raise ValueError("train.max_steps must be >= 1")
        if self.warmup_steps < 1 or self.warmup_steps >= self.max_steps:
            raise ValueError(
                f"train.warmup_steps ({self.warmup_steps}) must be >= 1 and < train.max_steps ({self.max_steps})"
            )
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError("train.label_smoothing must be in [0, 1)")
        for name in ("save_every_steps", "keep_last", "valid_every_steps", "log_every_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class AverageConfig:
    """Stage ``average``: checkpoint averaging."""

    last_n: int = 5

    def __post_init__(self) -> None:
        if self.last_n < 1:
            raise ValueError("average.last_n must be >= 1")


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    """Stage ``evaluate``: beam search grid (chosen on valid) and decoding budget."""

    beam_sizes: list[int] = field(default_factory=lambda: [4])
    alphas: list[float] = field(default_factory=lambda: [0.6])
    max_len_a: float = 1.0
    max_len_b: int = 50
    max_tokens: int = 8192

    def __post_init__(self) -> None:
        if not self.beam_sizes or min(self.beam_sizes) < 1:
            raise ValueError("evaluate.beam_sizes must be a non-empty list of integers >= 1")
        if not self.alphas:
            raise ValueError("evaluate.alphas must be a non-empty list")


@dataclass(frozen=True, kw_only=True)
class Params:
    """The whole of params.yaml."""

    profile: str
    seed: int
    paths: PathsConfig
    download: DownloadConfig
    clean: CleanConfig
    bpe: BpeConfig
    encode: EncodeConfig
    model: TransformerConfig  # the network's own config (model/config.py); vocab_size comes from the BPE model
    train: TrainConfig
    average: AverageConfig
    evaluate: EvaluateConfig

    def __post_init__(self) -> None:
        longest = self.encode.max_len + 1  # + EOS / BOS
        if self.train.tokens_per_step < longest:
            raise ValueError(
                f"train.tokens_per_step ({self.train.tokens_per_step}) must be >= encode.max_len + 1 ({longest}): "
                "the longest allowed target would not fit in any step"
            )
        if self.train.keep_last < self.average.last_n:
            raise ValueError(
                f"train.keep_last ({self.train.keep_last}) must be >= average.last_n ({self.average.last_n}): "
                "averaging needs that many checkpoints"
            )
        if self.model.max_positions < longest:
            raise ValueError(f"model.max_positions ({self.model.max_positions}) must be >= encode.max_len + 1")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_value(value: Any, tp: Any, key: str, errors: list[str]) -> Any:
    """Check ``value`` against annotation ``tp``; append an error naming ``key`` on mismatch."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, errors)
    if origin is Literal:
        if value not in typing.get_args(tp):
            errors.append(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_value(value, inner[0], key, errors)
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{key}: expected a list, got {type(value).__name__} {value!r}")
            return value
        (item_tp,) = typing.get_args(tp)
        return [_check_value(v, item_tp, f"{key}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
            return value
        _, val_tp = typing.get_args(tp)
        return {str(k): _check_value(v, val_tp, f"{key}.{k}", errors) for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool) or not isinstance(value, tp):
        errors.append(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _build(cls: type, data: Any, prefix: str, errors: list[str]) -> Any:
    """Build dataclass ``cls`` from mapping ``data``, collecting every problem into ``errors``."""
    where = prefix or "params"
    if not isinstance(data, dict):
        errors.append(f"{where}: expected a mapping, got {type(data).__name__}")
        return None
    hints = typing.get_type_hints(cls)
    every = {f.name: f for f in dataclasses.fields(cls)}
    fields = {name: f for name, f in every.items() if DERIVED not in f.metadata}
    dotted = (prefix + ".") if prefix else ""
    for key in sorted(set(data) - set(fields)):
        if f"{dotted}{key}" in MOVED_TO_ENV:
            errors.append(f"{dotted}{key}: moved to the environment variable {MOVED_TO_ENV[dotted + key]} "
                          "(hardware, not a result-changing param); delete the key")
        elif key in every:
            errors.append(f"{dotted}{key}: not a setting (it is {every[key].metadata[DERIVED]}); remove it")
        else:
            errors.append(f"{dotted}{key}: unknown key (known keys here: {', '.join(fields)})")
    kwargs: dict[str, Any] = {}
    n_before = len(errors)
    for name in fields:
        if name not in data:  # defaults serve code; a params file must still spell out every key
            errors.append(f"{dotted}{name}: missing key")
            continue
        kwargs[name] = _check_value(data[name], hints[name], f"{dotted}{name}", errors)
    if len(errors) > n_before:
        return None
    try:
        return cls(**kwargs)
    except ValueError as exc:  # cross-field rules from __post_init__
        errors.append(f"{where}: {exc}")
        return None


def params_from_dict(data: dict[str, Any], source: str = "params.yaml") -> Params:
    """Build :class:`Params` from a parsed mapping; raise one error listing every bad key."""
    errors: list[str] = []
    params = _build(Params, data, "", errors)
    if errors or params is None:
        raise ConfigError(source, errors or ["invalid configuration"])
    return params


def load_params(path: str | Path = "params.yaml") -> Params:
    """Load and validate ``path`` (a params.yaml)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(str(path), ["file not found: run from the repository root or pass --params"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {exc}"]) from None
    return params_from_dict(data or {}, str(path))


def section_dict(obj: Any) -> dict[str, Any]:
    """A dataclass section (or all of :class:`Params`) as a plain dict of its settings, as params.yaml
    spells them (derived values such as the model's vocabulary size left out): for tracking and audit."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: section_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if DERIVED not in f.metadata}
    if isinstance(obj, list):
        return [section_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: section_dict(v) for k, v in obj.items()}
    return obj


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings to dotted keys (``train.max_tokens``) for MLflow params."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out
