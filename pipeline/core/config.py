"""params.yaml → one tree of frozen pydantic models: each key's type, default, range and cross-field rule beside
it; :func:`params_from_dict` reports every problem at once, one line each, naming the dotted key
(:mod:`pipeline.core.problems` words pydantic's errors). The model section is the network's own
``model.TransformerConfig`` (a stdlib dataclass: ``model/`` knows nothing of pydantic), validated through
:class:`ModelSection`, which takes its fields from it and adds their ranges."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from model.config import DERIVED, MAX_ALPHA, MAX_BEAM_SIZE, MAX_WEIGHTS, TransformerConfig, beam_size_problem
from pipeline.core.errors import ConfigError
from pipeline.core.paths import layout_problems, path_problem
from pipeline.core.problems import missing_keys, problems_of, shown
from pipeline.core.yamlfile import PlainMapping, load_yaml

#: The ``train`` keys a run may change and still resume its checkpoints (where it stops, how often it saves/logs).
RESUMABLE_TRAIN_KEYS = frozenset({"max_steps", "max_epochs", "max_minutes", "save_every_steps", "keep_last",
                                  "valid_every_steps", "log_every_steps"})
#: Keys that left params.yaml for an ``NMT_*`` variable: a params file that still has one fails naming it.
MOVED_TO_ENV = {"train.max_tokens": "NMT_MAX_TOKENS"}


class Section(BaseModel):
    """A params.yaml section: unknown keys refused, no coercion (``1`` is no bool, ``"2"`` no int), finite floats."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    #: Keys of the section that are not settings, with what each one is (an error says so when a file has one).
    derived: ClassVar[dict[str, str]] = {}


def _path(value: str) -> str:
    if "\0" in value:
        raise ValueError(f"{shown(value)} holds a NUL byte, which no file name may hold; remove it")
    if problem := path_problem(value):
        raise ValueError(problem)
    return value


OutputPath = Annotated[str, AfterValidator(_path)]
Positive = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
Probability = Annotated[float, Field(ge=0, lt=1)]
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]


class PathsConfig(Section):
    """Where each stage reads and writes; dvc.yaml templates its paths from here."""

    raw: OutputPath
    clean: OutputPath
    bpe: OutputPath
    shards: OutputPath
    train: OutputPath
    model: OutputPath
    eval: OutputPath
    metrics: OutputPath
    plots: OutputPath
    reports: OutputPath


class DownloadConfig(Section):
    """Stage ``download``: which dataset, how hard to try, which checksums to enforce."""

    dataset: Literal["wmt14", "multi30k"]
    retries: Count = 5
    timeout_s: float = Field(60.0, gt=0)
    #: Expected sha256 per upstream file name (archive or member); empty = record on first download.
    sha256: dict[str, str] = Field(default_factory=dict)


class CleanConfig(Section):
    """Stage ``clean``: training-pair filters (valid/test pass through complete)."""

    max_words: Positive = 250
    max_ratio: float = Field(1.5, ge=1)  # longer side / shorter side
    min_words: Positive = 1
    dedup: bool = True
    drop_copies: bool = True

    @model_validator(mode="after")
    def _words(self) -> CleanConfig:
        if self.max_words < self.min_words:
            raise ValueError(f"clean.min_words ({self.min_words}) must be <= clean.max_words ({self.max_words})")
        return self


class BpeConfig(Section):
    """Stage ``bpe``: joint SentencePiece BPE over both languages."""

    vocab_size: int = Field(37000, ge=8)  # 4 special ids + pieces
    input_sentence_size: Count = 10_000_000  # 0 = every sentence
    character_coverage: float = Field(1.0, gt=0, le=1)
    seed: Seed = 1


class EncodeConfig(Section):
    """Stage ``encode``: BPE ids into Parquet shards."""

    max_len: Positive = 256
    shard_rows: Positive = 250_000


class TrainConfig(Section):
    """Stage ``train``: batching, optimiser, schedule, stopping, checkpoints (0 = off for the ``max_*`` limits)."""

    tokens_per_step: Positive = 25000
    lr_scale: float = Field(1.0, gt=0)
    warmup_steps: Positive = 4000
    adam_beta1: Probability = 0.9
    adam_beta2: Probability = 0.98
    adam_eps: float = Field(1e-9, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    label_smoothing: Probability = 0.1
    clip_norm: float = Field(0.0, ge=0)
    max_steps: Positive = 100_000
    max_epochs: Count = 0
    max_minutes: float = Field(0.0, ge=0)
    save_every_steps: Positive = 1000
    keep_last: Positive = 5
    valid_every_steps: Positive = 1000
    log_every_steps: Positive = 100

    @model_validator(mode="after")
    def _warmup(self) -> TrainConfig:
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"train.warmup_steps ({self.warmup_steps}) must be >= 1 and < train.max_steps "
                             f"({self.max_steps})")
        return self


class AverageConfig(Section):
    """Stage ``average``: checkpoint averaging."""

    last_n: Positive = 5


class EvaluateConfig(Section):
    """Stage ``evaluate``: beam search grid (chosen on valid), its rule (:mod:`model.beam_rules`), decoding budget."""

    beam_sizes: list[Annotated[int, Field(ge=1, le=MAX_BEAM_SIZE)]] = Field(default_factory=lambda: [4])
    alphas: list[Annotated[float, Field(ge=0, le=MAX_ALPHA)]] = Field(default_factory=lambda: [0.6])
    beam_rule: Literal["fairseq", "t2t"] = "fairseq"
    max_len_a: float = Field(1.0, ge=0)
    max_len_b: Count = 50
    max_tokens: Positive = 8192

    @model_validator(mode="after")
    def _grid(self) -> EvaluateConfig:
        if not self.beam_sizes:
            raise ValueError("evaluate.beam_sizes must be a non-empty list of integers >= 1")
        if not self.alphas:
            raise ValueError("evaluate.alphas must be a non-empty list")
        for key, values in (("beam_sizes", self.beam_sizes), ("alphas", self.alphas)):
            if repeated := next((v for i, v in enumerate(values) if v in values[:i]), None):
                raise ValueError(f"evaluate.{key}: {shown(repeated)} appears {values.count(repeated)} times, and "
                                 "each decodes the whole valid set again; list each value once")
        return self


#: The range of each numeric field of ``model.TransformerConfig`` (its fields, types and defaults are its own).
MODEL_RANGES: dict[str, dict[str, float]] = {
    "d_model": {"ge": 1}, "n_heads": {"ge": 1}, "d_ff": {"ge": 1}, "n_layers": {"ge": 1}, "max_positions": {"ge": 1},
    "dropout": {"ge": 0, "lt": 1}, "attn_dropout": {"ge": 0, "lt": 1}, "ffn_dropout": {"ge": 0, "lt": 1}}
_MODEL_HINTS = typing.get_type_hints(TransformerConfig)
ModelSection: type[Section] = create_model(  # type: ignore[call-overload]
    "ModelSection", __base__=Section, __doc__="params.yaml's ``model``: the settings of ``TransformerConfig``.",
    **{f.name: (_MODEL_HINTS[f.name], Field(f.default, **MODEL_RANGES.get(f.name, {})))
       for f in dataclasses.fields(TransformerConfig) if DERIVED not in f.metadata})
ModelSection.derived = {f.name: f.metadata[DERIVED] for f in dataclasses.fields(TransformerConfig)
                        if DERIVED in f.metadata}


def _network(section: BaseModel) -> TransformerConfig:
    return TransformerConfig(**section.model_dump())


class Params(Section):
    """The whole of params.yaml."""

    profile: str
    seed: Seed
    paths: PathsConfig
    download: DownloadConfig
    clean: CleanConfig
    bpe: BpeConfig
    encode: EncodeConfig
    #: The network's own config (model/config.py); vocab_size comes from the BPE model.
    model: Annotated[ModelSection, AfterValidator(_network)]  # type: ignore[valid-type]
    train: TrainConfig
    average: AverageConfig
    evaluate: EvaluateConfig

    @model_validator(mode="after")
    def _across(self) -> Params:
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
        return self


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


def params_from_dict(data: PlainMapping, source: str = "params.yaml") -> Params:
    """Build :class:`Params` from a parsed mapping (every key present); raise one ConfigError listing every bad key."""
    missing = missing_keys(Params, data)
    try:
        params = Params.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, problems_of(exc, Params, MOVED_TO_ENV, missing)) from None
    if missing:
        raise ConfigError(source, missing)
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
    if problems := layout_problems(section_dict(params.paths), path.parent, params.profile):
        raise ConfigError(str(path), problems)
    return params


def section_dict(obj: Any) -> Any:
    """A section (or all of :class:`Params`) as the plain dict params.yaml spells (derived values left out)."""
    if isinstance(obj, BaseModel):
        return {name: section_dict(getattr(obj, name)) for name in type(obj).model_fields}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: section_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if DERIVED not in f.metadata}
    if isinstance(obj, list):
        return [section_dict(v) for v in obj]
    return {k: section_dict(v) for k, v in obj.items()} if isinstance(obj, dict) else obj


def flatten(data: PlainMapping, prefix: str = "") -> PlainMapping:
    """Flatten nested mappings to dotted keys (``train.max_tokens``) for MLflow params."""
    out: PlainMapping = {}
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
