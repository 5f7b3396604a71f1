"""params.yaml → one tree of frozen, keyword-only dataclasses, built strictly by :mod:`pipeline.core.strict`;
each numeric key's range is in :data:`RANGES`, cross-field rules in the ``__post_init__`` of their section."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from model.config import DERIVED, MAX_ALPHA, MAX_BEAM_SIZE, MAX_WEIGHTS, TransformerConfig, beam_size_problem
from pipeline.core.errors import ConfigError
from pipeline.core.paths import layout_problems, path_problem
from pipeline.core.strict import Range, build, shown
from pipeline.core.yamlfile import load_yaml

#: The ``train`` keys a run may change and still resume its checkpoints (where it stops, how often it saves/logs).
RESUMABLE_TRAIN_KEYS = frozenset({"max_steps", "max_epochs", "max_minutes", "save_every_steps", "keep_last",
                                  "valid_every_steps", "log_every_steps"})
#: Keys that left params.yaml for an ``NMT_*`` variable: a params file that still has one fails naming it.
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


@dataclass(frozen=True, kw_only=True)
class CleanConfig:
    """Stage ``clean``: training-pair filters (valid/test pass through complete)."""

    max_words: int = 250
    max_ratio: float = 1.5
    min_words: int = 1
    dedup: bool = True
    drop_copies: bool = True

    def __post_init__(self) -> None:
        if self.max_words < self.min_words:
            raise ValueError(f"clean.min_words ({self.min_words}) must be <= clean.max_words ({self.max_words})")


@dataclass(frozen=True, kw_only=True)
class BpeConfig:
    """Stage ``bpe``: joint SentencePiece BPE over both languages."""

    vocab_size: int = 37000
    input_sentence_size: int = 10_000_000
    character_coverage: float = 1.0
    seed: int = 1


@dataclass(frozen=True, kw_only=True)
class EncodeConfig:
    """Stage ``encode``: BPE ids into Parquet shards."""

    max_len: int = 256
    shard_rows: int = 250_000


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
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"train.warmup_steps ({self.warmup_steps}) must be >= 1 and < train.max_steps "
                             f"({self.max_steps})")


@dataclass(frozen=True, kw_only=True)
class AverageConfig:
    """Stage ``average``: checkpoint averaging."""

    last_n: int = 5


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    """Stage ``evaluate``: beam search grid (chosen on valid), its rule (:mod:`model.beam_rules`), decoding budget."""

    beam_sizes: list[int] = field(default_factory=lambda: [4])
    alphas: list[float] = field(default_factory=lambda: [0.6])
    beam_rule: Literal["fairseq", "t2t"] = "fairseq"
    max_len_a: float = 1.0
    max_len_b: int = 50
    max_tokens: int = 8192

    def __post_init__(self) -> None:
        if not self.beam_sizes:
            raise ValueError("evaluate.beam_sizes must be a non-empty list of integers >= 1")
        if not self.alphas:
            raise ValueError("evaluate.alphas must be a non-empty list")
        for key, values in (("beam_sizes", self.beam_sizes), ("alphas", self.alphas)):
            if repeated := next((v for i, v in enumerate(values) if v in values[:i]), None):
                raise ValueError(f"evaluate.{key}: {shown(repeated)} appears {values.count(repeated)} times, and "
                                 "each decodes the whole valid set again; list each value once")


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
            raise ValueError(f"train.tokens_per_step ({self.train.tokens_per_step}) must be >= encode.max_len + 1 "
                             f"({longest}): the longest allowed target would not fit in any step")
        if self.train.keep_last < self.average.last_n:
            raise ValueError(f"train.keep_last ({self.train.keep_last}) must be >= average.last_n "
                             f"({self.average.last_n}): averaging needs that many checkpoints")
        if self.model.max_positions < longest:
            raise ValueError(f"model.max_positions ({self.model.max_positions}) must be >= encode.max_len + 1")
        for problem in (_model_size_problem(self.model, self.bpe.vocab_size),
                        _beam_vocabulary_problem(self.evaluate.beam_sizes, self.bpe.vocab_size)):
            if problem:
                raise ValueError(problem)


def _model_size_problem(model: TransformerConfig, vocab_size: int) -> str | None:
    """Why the model has more than ``MAX_WEIGHTS`` weights, naming the key furthest above the base model, or None."""
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
                  "weight_decay": _NON_NEGATIVE, "label_smoothing": _PROBABILITY, "max_steps": _POSITIVE,
                  "clip_norm": _NON_NEGATIVE, "max_epochs": _NON_NEGATIVE, "max_minutes": _NON_NEGATIVE,  # 0 = off
                  "save_every_steps": _POSITIVE, "keep_last": _POSITIVE, "valid_every_steps": _POSITIVE,
                  "log_every_steps": _POSITIVE},
    AverageConfig: {"last_n": _POSITIVE},
    EvaluateConfig: {"beam_sizes": Range(ge=1, le=MAX_BEAM_SIZE),  # and <= bpe.vocab_size (Params)
                     "alphas": Range(ge=0, le=MAX_ALPHA), "max_len_a": _NON_NEGATIVE, "max_len_b": _NON_NEGATIVE,
                     "max_tokens": _POSITIVE},
}


def _key_problems(cls: type, name: str, value: Any) -> list[tuple[str, str]]:
    """``(item suffix, problem)`` for each rule that the (type-correct) value of ``cls.name`` breaks."""
    if cls is PathsConfig:
        problem = (f"{shown(value)} holds a NUL byte, which no file name may hold; remove it" if "\0" in value
                   else path_problem(value))
        return [("", problem)] if problem else []
    if (rng := RANGES.get(cls, {}).get(name)) is None:
        return []
    items = enumerate(value) if isinstance(value, list) else [(None, value)]
    return [("" if i is None else f"[{i}]", problem) for i, v in items if (problem := rng.problem(v))]


def params_from_dict(data: dict[str, Any], source: str = "params.yaml") -> Params:
    """Build :class:`Params` from a parsed mapping; raise one ConfigError listing every bad key."""
    return build(Params, data, source, rules=_key_problems, moved=MOVED_TO_ENV)


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
    if problems := layout_problems(section_dict(params.paths), path.parent, params.profile):
        raise ConfigError(str(path), problems)
    return params


def section_dict(obj: Any) -> dict[str, Any]:
    """A section (or all of :class:`Params`) as the plain dict params.yaml spells (derived values left out)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: section_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if DERIVED not in f.metadata}
    if isinstance(obj, list):
        return [section_dict(v) for v in obj]
    return {k: section_dict(v) for k, v in obj.items()} if isinstance(obj, dict) else obj


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


def checkpoint_folder(params: Params) -> Path:
    """The training folder of ``params``: ``<paths.train>/<digest>``, the digest (12 hex) of the config checkpoints
    resume under (``seed``, ``model``, ``train`` but :data:`RESUMABLE_TRAIN_KEYS`). A run that changes training
    (``dvc exp run -S train.warmup_steps=8``) starts in a folder of its own and leaves the others' checkpoints alone;
    the same config (or one changing only where it stops) finds its folder and resumes."""
    train = {k: v for k, v in section_dict(params.train).items() if k not in RESUMABLE_TRAIN_KEYS}
    keyed = {"seed": params.seed, "model": section_dict(params.model), "train": train}
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
    return Path(params.paths.train) / digest
