"""params.yaml → one tree of frozen, keyword-only dataclasses.

Every unknown, missing, mistyped or out-of-range key is collected and reported together in one
:class:`ConfigError` that names each key by its dotted path, one line per problem. Each numeric key's
valid range is in :data:`RANGES` (checked once the key's type is right; a test makes every numeric
field have one), and every ``paths.*`` value must lie inside one of :data:`OUTPUT_ROOTS` (the layout as a
whole, overlaps and other profiles included, is :mod:`pipeline.core.paths`'s, checked by :func:`load_params`).
Cross-field rules live in ``__post_init__`` of the section they concern (they run only once every key is valid).
Derived values (vocabulary size, forward passes per step) are computed elsewhere, never stored. The
``model`` section validates into the network's own :class:`model.config.TransformerConfig` (its
derived fields, the vocabulary size and special ids, are not params).
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from model.config import DERIVED, MAX_BEAM_SIZE, MAX_WEIGHTS, TransformerConfig, beam_size_problem
from pipeline.core.errors import ConfigError
from pipeline.core.paths import layout_problems
from pipeline.core.yamlfile import load_yaml

DATASETS = ("wmt14", "multi30k")
CHECKOUT = Path(__file__).resolve().parents[2]
#: Keys that left params.yaml for an ``NMT_*`` variable (pipeline/core/env.py): a params file that
#: still has one fails naming the variable.
MOVED_TO_ENV = {"train.max_tokens": "NMT_MAX_TOKENS"}
#: The git-ignored output folders: every ``paths.*`` value lies strictly inside one of them, so a stage
#: that clears its output can never delete tracked files (docs/, src/) or write outside the repository.
OUTPUT_ROOTS = ("data", "runs", "metrics", "plots", "reports")
PATH_RULE = (f"a relative path without '..' inside one of {', '.join(r + '/' for r in OUTPUT_ROOTS)}; "
             "an absolute path only for a params file kept outside the checkout, inside that file's folder")


def path_problem(value: str) -> str | None:
    """Why ``value`` may not be a ``paths.*`` setting, or None if it may.

    A relative path must lie inside one of :data:`OUTPUT_ROOTS` of the checkout (no ``..``). An absolute
    path inside the checkout is refused like a relative path outside the output folders; one outside it
    passes this per-key rule, and :func:`load_params` then accepts it only inside the params file's folder.
    """
    parts = PurePosixPath(value).parts
    if value.startswith(("/", "\\")) or PurePosixPath(value).is_absolute():
        if ".." not in parts and not Path(value).resolve().is_relative_to(CHECKOUT):
            return None
        reason = "is absolute and inside the checkout or has '..'"
    elif ".." in parts:
        reason = "has a '..' component"
    elif len(parts) < 2 or parts[0] not in OUTPUT_ROOTS:
        reason = "is not inside an output folder"
    else:
        return None
    return f"{shown(value)} {reason} (expected {PATH_RULE})"


@dataclass(frozen=True)
class Range:
    """The valid values of one numeric key (of each item, for a list); None = unbounded that side."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def __str__(self) -> str:
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        return ("<= " if high[-1] == "]" else "< ") + high[:-1] if high else "any number"

    def problem(self, value: float) -> str | None:
        """Why ``value`` is out of range, or None if it is in range (NaN and infinities never are)."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"{shown(value)} is not a finite number (expected {self})"
        ok = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
              and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        return None if ok else f"{shown(value)} is out of range (expected {self})"


def _refuse_invalid(obj: Any) -> None:
    """``__post_init__`` of a directly built section: the per-key rules the loader checks, as a ValueError."""
    problems = [f"{type(obj).__name__}.{f.name}{where}: {problem}" for f in dataclasses.fields(obj)
                for where, problem in _key_problems(type(obj), f.name, getattr(obj, f.name))]
    if problems:
        raise ValueError("; ".join(problems))


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

    def __post_init__(self) -> None:
        _refuse_invalid(self)


@dataclass(frozen=True, kw_only=True)
class DownloadConfig:
    """Stage ``download``: which dataset, how hard to try, which checksums to enforce."""

    dataset: Literal["wmt14", "multi30k"]
    retries: int = 5
    timeout_s: float = 60.0
    # Expected sha256 per upstream file name (archive or member); empty = record on first download.
    sha256: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _refuse_invalid(self)


@dataclass(frozen=True, kw_only=True)
class CleanConfig:
    """Stage ``clean``: training-pair filters (valid/test pass through complete)."""

    max_words: int = 250
    max_ratio: float = 1.5
    min_words: int = 1
    dedup: bool = True
    drop_copies: bool = True

    def __post_init__(self) -> None:
        _refuse_invalid(self)
        if self.max_words < self.min_words:
            raise ValueError(f"clean.min_words ({self.min_words}) must be <= clean.max_words ({self.max_words})")


@dataclass(frozen=True, kw_only=True)
class BpeConfig:
    """Stage ``bpe``: joint SentencePiece BPE over both languages."""

    vocab_size: int = 37000
    input_sentence_size: int = 10_000_000
    character_coverage: float = 1.0
    seed: int = 1

    def __post_init__(self) -> None:
        _refuse_invalid(self)


@dataclass(frozen=True, kw_only=True)
class EncodeConfig:
    """Stage ``encode``: BPE ids into Parquet shards."""

    max_len: int = 256
    shard_rows: int = 250_000

    def __post_init__(self) -> None:
        _refuse_invalid(self)


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
        _refuse_invalid(self)
        if self.warmup_steps >= self.max_steps:
            raise ValueError(
                f"train.warmup_steps ({self.warmup_steps}) must be >= 1 and < train.max_steps ({self.max_steps})"
            )


@dataclass(frozen=True, kw_only=True)
class AverageConfig:
    """Stage ``average``: checkpoint averaging."""

    last_n: int = 5

    def __post_init__(self) -> None:
        _refuse_invalid(self)


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    """Stage ``evaluate``: beam search grid (chosen on valid) and decoding budget."""

    beam_sizes: list[int] = field(default_factory=lambda: [4])
    alphas: list[float] = field(default_factory=lambda: [0.6])
    max_len_a: float = 1.0
    max_len_b: int = 50
    max_tokens: int = 8192

    def __post_init__(self) -> None:
        _refuse_invalid(self)
        if not self.beam_sizes:
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
        _refuse_invalid(self)
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
        for problem in (_model_size_problem(self.model, self.bpe.vocab_size),
                        _beam_vocabulary_problem(self.evaluate.beam_sizes, self.bpe.vocab_size)):
            if problem:
                raise ValueError(problem)


def _model_size_problem(model: TransformerConfig, vocab_size: int) -> str | None:
    """Why the model that ``model`` and ``bpe.vocab_size`` describe cannot be trained here, or None.

    It can not when it holds more than :data:`model.config.MAX_WEIGHTS` numbers; the key named is the one
    furthest above the paper's base model (``model.d_model: 1e12`` once died in training naming no key).
    """
    count = model.weight_count(vocab_size)
    if count <= MAX_WEIGHTS:
        return None
    base_model, base_bpe = TransformerConfig(), BpeConfig()
    sizes = {f"model.{name}": (getattr(model, name), getattr(base_model, name))
             for name in ("d_model", "d_ff", "n_layers", "max_positions")}
    sizes["bpe.vocab_size"] = (vocab_size, base_bpe.vocab_size)
    key = max(sizes, key=lambda k: math.log(sizes[k][0]) - math.log(sizes[k][1]))  # exact for huge ints
    others = ", ".join(f"{k} {shown(v)}" for k, (v, _) in sizes.items() if k != key)
    amount = f"{count:.2e}" if count < 10**300 else f"about 2^{count.bit_length() - 1}"
    return (f"{key}: {shown(sizes[key][0])} makes a model of {amount} weights (with {others}), more than the "
            f"{MAX_WEIGHTS:.2e} one GPU can train (model.config.MAX_WEIGHTS: fp32 weights, gradients and Adam's "
            f"moments take 16 bytes each); lower {key}")


def _beam_vocabulary_problem(beam_sizes: list[int], vocab_size: int) -> str | None:
    """Why a beam of ``evaluate.beam_sizes`` cannot search ``bpe.vocab_size`` pieces, or None."""
    for i, beam in enumerate(beam_sizes):
        if problem := beam_size_problem(beam, vocab_size):
            return f"evaluate.beam_sizes[{i}]: {shown(beam)} {problem} (bpe.vocab_size); lower it"
    return None


#: The longest rendering of a user's value in an error message (:func:`shown`).
SHOWN_CHARS = 80
#: The most problems one :class:`ConfigError` lists (the rest are counted).
MAX_PROBLEMS = 30
_REPR = reprlib.Repr()  # a few items of each container, a few levels deep (Repr takes no arguments before 3.12)
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 3, 4, 4
_REPR.maxlong = _REPR.maxstring = _REPR.maxother = SHOWN_CHARS

_POSITIVE, _NON_NEGATIVE, _PROBABILITY = Range(ge=1), Range(ge=0), Range(ge=0, lt=1)
_SEED = Range(ge=0, le=2**32 - 1)

#: The valid range of every numeric key, by section class and field name (a list's range is each item's).
RANGES: dict[type, dict[str, Range]] = {
    Params: {"seed": _SEED},
    DownloadConfig: {"retries": _NON_NEGATIVE, "timeout_s": Range(gt=0)},
    CleanConfig: {"max_words": _POSITIVE, "max_ratio": Range(ge=1),  # longer side / shorter side
                  "min_words": _POSITIVE},
    BpeConfig: {"vocab_size": Range(ge=8),  # 4 special ids + pieces
                "input_sentence_size": _NON_NEGATIVE,  # 0 = every sentence
                "character_coverage": Range(gt=0, le=1), "seed": _SEED},
    EncodeConfig: {"max_len": _POSITIVE, "shard_rows": _POSITIVE},
    TransformerConfig: {"d_model": _POSITIVE, "n_heads": _POSITIVE, "d_ff": _POSITIVE, "n_layers": _POSITIVE,
                        "dropout": _PROBABILITY, "attn_dropout": _PROBABILITY, "ffn_dropout": _PROBABILITY,
                        "max_positions": _POSITIVE},
    TrainConfig: {"tokens_per_step": _POSITIVE, "lr_scale": Range(gt=0), "warmup_steps": _POSITIVE,
                  "adam_beta1": _PROBABILITY, "adam_beta2": _PROBABILITY, "adam_eps": Range(gt=0),
                  "weight_decay": _NON_NEGATIVE, "label_smoothing": _PROBABILITY,
                  "clip_norm": _NON_NEGATIVE,  # 0 = no clipping
                  "max_steps": _POSITIVE,
                  "max_epochs": _NON_NEGATIVE, "max_minutes": _NON_NEGATIVE,  # 0 = no limit
                  "save_every_steps": _POSITIVE, "keep_last": _POSITIVE, "valid_every_steps": _POSITIVE,
                  "log_every_steps": _POSITIVE},
    AverageConfig: {"last_n": _POSITIVE},
    EvaluateConfig: {"beam_sizes": Range(ge=1, le=MAX_BEAM_SIZE),  # and <= bpe.vocab_size (Params)
                     "alphas": _NON_NEGATIVE, "max_len_a": _NON_NEGATIVE, "max_len_b": _NON_NEGATIVE,
                     "max_tokens": _POSITIVE},
}


def _key_problems(cls: type, name: str, value: Any) -> list[tuple[str, str]]:
    """``(item suffix, problem)`` for each rule that the (type-correct) value of ``cls.name`` breaks."""
    if cls is PathsConfig:
        problem = path_problem(value)
        return [("", problem)] if problem else []
    rng = RANGES.get(cls, {}).get(name)
    if rng is None:
        return []
    items = enumerate(value) if isinstance(value, list) else [(None, value)]
    return [("" if i is None else f"[{i}]", problem) for i, v in items if (problem := rng.problem(v))]


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, bounded: at most :data:`SHOWN_CHARS` characters, built
    without walking more than a few items of a nested list or mapping (a value in a params file can be
    arbitrarily large)."""
    text = _REPR.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def _key_text(key: Any) -> str:
    """A mapping key as an error message names it (a long one cut like :func:`shown`)."""
    text = str(key) if isinstance(key, (str, int)) else shown(key)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_value(value: Any, tp: Any, key: str, errors: list[str]) -> Any:
    """Check ``value`` against annotation ``tp``; append an error naming ``key`` on mismatch."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, errors)
    if origin is Literal:
        if value not in typing.get_args(tp):
            errors.append(f"{key}: {shown(value)} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_value(value, inner[0], key, errors)
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{key}: expected a list, got {type(value).__name__} {shown(value)}")
            return value
        (item_tp,) = typing.get_args(tp)
        return [_check_value(v, item_tp, f"{key}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{key}: expected a mapping, got {type(value).__name__} {shown(value)}")
            return value
        _, val_tp = typing.get_args(tp)
        return {str(k): _check_value(v, val_tp, f"{key}.{_key_text(k)}", errors) for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool) or not isinstance(value, tp):
        errors.append(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {shown(value)}")
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
    for key in sorted(set(data) - set(fields), key=str):
        if not isinstance(key, str):
            errors.append(f"{dotted}{_key_text(key)}: unknown key, and not text (known keys here: {', '.join(fields)})")
        elif f"{dotted}{key}" in MOVED_TO_ENV:
            errors.append(f"{dotted}{key}: moved to the environment variable {MOVED_TO_ENV[dotted + key]} "
                          "(hardware, not a result-changing param); delete the key")
        elif key in every:
            errors.append(f"{dotted}{key}: not a setting (it is {every[key].metadata[DERIVED]}); remove it")
        else:
            errors.append(f"{dotted}{_key_text(key)}: unknown key (known keys here: {', '.join(fields)})")
    kwargs: dict[str, Any] = {}
    n_before = len(errors)
    for name in fields:
        if name not in data:  # defaults serve code; a params file must still spell out every key
            errors.append(f"{dotted}{name}: missing key")
            continue
        n_key = len(errors)
        kwargs[name] = _check_value(data[name], hints[name], f"{dotted}{name}", errors)
        if len(errors) == n_key:  # the type is right: now the range (or the paths rule)
            errors.extend(f"{dotted}{name}{where}: {problem}"
                          for where, problem in _key_problems(cls, name, kwargs[name]))
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
    if len(errors) > MAX_PROBLEMS:  # a list of a million wrong items: say so once, not a million times
        errors[MAX_PROBLEMS - 1:] = [f"... and {len(errors) - MAX_PROBLEMS + 1} more problem(s) like these"]
    if errors or params is None:
        raise ConfigError(source, errors or ["invalid configuration"])
    return params


def load_params(path: str | Path = "params.yaml") -> Params:
    """Load and validate ``path`` (a params.yaml; no YAML anchors or aliases, see :func:`load_yaml`)."""
    path = Path(path)
    try:
        data = load_yaml(path)
    except FileNotFoundError:
        raise ConfigError(str(path), ["file not found: run from the repository root or pass --params"]) from None
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot be read ({exc.strerror or exc}); pass a readable file"]) from None
    params = params_from_dict(data or {}, str(path))
    problems = layout_problems(section_dict(params.paths), path.parent, params.profile)
    if problems:
        raise ConfigError(str(path), problems)
    return params


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
