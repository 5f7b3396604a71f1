"""A sweep's spec file (``nmt sweep SPEC.yaml``; docs/orchestration.md): read, checked against params.yaml, expanded.

Ours and not DVC's ``-S 'key=choice(...)'`` sweeps: DVC expands those only into ``--queue`` runs
(dvc/repo/experiments/run.py), which a sweep does not use (:mod:`flows.sweep`), and checks no key or value
against params.yaml first.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline.core.config import flatten, params_from_dict, section_dict
from pipeline.core.paths import layout_problems
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.core.problems import problems_of
from pipeline.core.yamlfile import load_yaml
from pipeline.project.profiles import check_profile, merged_profile

MAX_VARIANTS = 64
MAX_CONCURRENCY = 16
DEFAULT_CONCURRENCY = 2
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}")


class SpecError(PipelineError):
    """A sweep spec that cannot run; the message names the file and the key."""

    def __init__(self, source: str | Path, problem: str) -> None:
        super().__init__(f"{source}: {problem}")


@dataclass(frozen=True)
class Variant:
    """One run of the sweep: 1-based ``index``, DVC experiment ``name``, own ``overrides``, ``applied`` (set + own)."""

    index: int
    name: str
    overrides: dict[str, Any]
    applied: dict[str, Any]

    @property
    def key(self) -> str:
        """A stable identity of the variant's applied overrides (its state-file key)."""
        return json.dumps(self.applied, sort_keys=True)

    def label(self) -> str:
        """``key=value, ...`` of its own overrides (``(base)`` when it has none)."""
        return ", ".join(f"{k}={json.dumps(v)}" for k, v in self.overrides.items()) or "(base)"


@dataclass(frozen=True)
class SweepSpec:
    """A checked spec: every variant's params validate."""

    source: str
    name: str
    profile: str
    concurrency: int
    shared: dict[str, Any]
    variants: tuple[Variant, ...]
    keys: tuple[str, ...] = ()  # the keys the variants vary, in spec order

    @property
    def run_name(self) -> str:
        """The MLflow parent run's name."""
        return f"sweep-{self.name}"


def _check_keys(source: str, where: str, overrides: dict[str, Any], known: dict[str, Any]) -> None:
    """Each key must be a dotted params key that names one setting (not a section, not unknown)."""
    for key in overrides:
        if not isinstance(key, str) or key not in known:
            section = str(key).split(".", 1)[0]
            inside = [k for k in known if k.startswith(f"{key}.")]  # params.yaml's order
            if inside:
                raise SpecError(source, f"{where}: {key} is a section of params.yaml, not a param; name one key "
                                        f"inside it, e.g. {inside[0]}")
            siblings = [k for k in known if k.startswith(f"{section}.")]
            hint = f"known in {section}: {', '.join(k.split('.', 1)[1] for k in siblings)}" if siblings else \
                f"known sections: {', '.join(dict.fromkeys(k.split('.', 1)[0] for k in known))}"
            raise SpecError(source, f"{where}: {key} is not a param of params.yaml ({hint})")


def _grid(source: str, grid: dict[str, list[Any]], known: dict[str, Any]) -> list[dict[str, Any]]:
    """The grid's cross product in spec order (its keys checked; at most :data:`MAX_VARIANTS`)."""
    _check_keys(source, "grid", grid, known)
    size = math.prod(len(values) for values in grid.values())
    if size > MAX_VARIANTS:
        raise SpecError(source, f"grid: {' x '.join(str(len(v)) for v in grid.values())} = {size} variants, "
                                f"more than the limit of {MAX_VARIANTS}; split the sweep")
    return [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]


def _with_seeds(source: str, seeds: list[int], own: list[dict[str, Any]], shared: dict[str, Any]
                ) -> list[dict[str, Any]]:
    """Each of ``own`` once per seed (``seed`` set last): the report's spread over seeds (flows/report.py)."""
    if "seed" in shared or any("seed" in overrides for overrides in own):
        raise SpecError(source, "seeds / seed: the seed is set in two places; keep it under seeds: only")
    return [{**overrides, "seed": seed} for overrides in own for seed in seeds]


def _check_not_shared(source: str, shared: dict[str, Any], own: list[dict[str, Any]], where: str) -> None:
    """A key the variants set must not be under ``set`` too: the variant's value would silently win."""
    for i, overrides in enumerate(own):
        both = [key for key in overrides if key in shared]
        if both:
            place = "grid" if where == "grid" else f"variants[{i}]"
            raise SpecError(source, f"set / {place}: {both[0]} is in both, and the variant's value would "
                                    "replace the shared one; keep the key in one of them")


def variant_params(base: dict[str, Any], applied: dict[str, Any]) -> dict[str, Any]:
    """``base`` with the dotted ``applied`` overrides set."""
    data = copy.deepcopy(base)
    for key, value in applied.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = copy.deepcopy(value)
    return data


class SpecFile(BaseModel):
    """A sweep spec as written (docs/orchestration.md): its keys, their types and ranges; what they mean for
    params.yaml (known keys, the variants' params) is checked by :func:`load_spec` against the profile."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(description="the sweep's name: its variants are <name>-1, <name>-2, ...")
    profile: str = Field(description="the profile (profiles/<profile>.yaml) every variant starts from")
    concurrency: int = Field(DEFAULT_CONCURRENCY, ge=1, le=MAX_CONCURRENCY, description="variants run at once")
    set: dict[str, Any] = Field(default_factory=dict, description="dotted params overrides every variant shares")
    grid: dict[str, Annotated[list[Any], Field(min_length=1)]] | None = Field(
        None, min_length=1, description="dotted params key -> its values; one variant per combination")
    variants: list[dict[str, Any]] | None = Field(None, min_length=1, description="one override mapping each")
    seeds: list[int] | None = Field(None, min_length=1, description="each variant once per seed")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a sweep name (letters, digits, - and _, at most 40, starting with a "
                             "letter or digit)")
        return name


def _header(source: str, data: Any, root: Path) -> SpecFile:
    """``data`` as a :class:`SpecFile` whose profile exists (a SpecError naming every bad key if not)."""
    if not isinstance(data, dict):
        raise SpecError(source, "expected a mapping with name, profile and grid, variants or seeds")
    try:
        spec = SpecFile.model_validate(data)
    except ValidationError as exc:
        missing = [f"{key}: missing" for key in ("name", "profile") if key not in data]
        raise SpecError(source, "; ".join(problems_of(exc, SpecFile, {}, missing))) from None
    if spec.grid is not None and spec.variants is not None or (spec.grid, spec.variants, spec.seeds) == (
            None, None, None):
        raise SpecError(source, "grid / variants: give one of them (or seeds: alone: the base profile per seed)")
    try:
        check_profile(spec.profile, root)
    except ConfigError as exc:
        raise SpecError(source, f"profile: {exc.problems[0]}") from None
    return spec


def load_spec(path: str | Path, root: str | Path = ".") -> SweepSpec:
    """Read and check a sweep spec against the profiles and params of the checkout ``root`` (a SpecError if not)."""
    source, root = str(path), Path(root)
    try:
        data = load_yaml(path)
    except FileNotFoundError:
        raise SpecError(source, "file not found") from None
    except OSError as exc:
        raise SpecError(source, f"cannot be read ({exc.strerror or exc}); pass a readable file") from None
    except ConfigError as exc:  # not YAML, an anchor or alias, too large: one line naming the place
        raise SpecError(source, exc.problems[0]) from None
    spec = _header(source, data, root)
    base = merged_profile(spec.profile, root)
    known = flatten(base)
    _check_keys(source, "set", spec.set, known)
    if spec.grid is not None:
        own = _grid(source, spec.grid, known)
    else:
        own = [dict(overrides) for overrides in spec.variants or [{}]]
        for i, overrides in enumerate(own):
            _check_keys(source, f"variants[{i}]", overrides, known)
    _check_not_shared(source, spec.set, own, "grid" if spec.grid is not None else "variants")
    if spec.seeds is not None:
        own = _with_seeds(source, spec.seeds, own, spec.set)
    if len(own) > MAX_VARIANTS:  # a grid's size was checked before it was expanded
        raise SpecError(source, f"{'seeds' if spec.seeds else 'variants'}: {len(own)} variants, more than the "
                                f"limit of {MAX_VARIANTS}; split the sweep")
    variants, seen = [], {}
    for i, overrides in enumerate(own, 1):
        variant = Variant(i, f"{spec.name}-{i}", overrides, {**spec.set, **overrides})
        if variant.key in seen:
            raise SpecError(source, f"variants {seen[variant.key]} and {i} are the same ({variant.label()})")
        seen[variant.key] = i
        try:
            params = params_from_dict(variant_params(base, variant.applied), f"variant {i}")
        except ConfigError as exc:
            raise SpecError(source, f"{exc} (profile {spec.profile} with {variant.label()})") from None
        if problems := layout_problems(section_dict(params.paths), root, spec.profile):  # the stage's own check
            raise SpecError(source, f"variant {i}: {problems[0]} (profile {spec.profile} with {variant.label()})")
        variants.append(variant)
    keys = tuple(dict.fromkeys(k for v in variants for k in v.overrides))
    return SweepSpec(source=source, name=spec.name, profile=spec.profile, concurrency=spec.concurrency,
                     shared=dict(spec.set), variants=tuple(variants), keys=keys)
