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
from typing import Any

from pipeline.core.config import flatten, params_from_dict, section_dict
from pipeline.core.paths import layout_problems
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.core.yamlfile import load_yaml
from pipeline.project.profiles import check_profile, merged_profile

MAX_VARIANTS = 64
MAX_CONCURRENCY = 16
DEFAULT_CONCURRENCY = 2
SPEC_KEYS = ("name", "profile", "concurrency", "set", "grid", "variants", "seeds")
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


def _mapping(source: str, key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(source, f"{key}: expected a mapping of dotted params keys to values, got "
                                f"{type(value).__name__}")
    return value


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


def _grid(source: str, grid: dict[str, Any], known: dict[str, Any]) -> list[dict[str, Any]]:
    if not grid:
        raise SpecError(source, "grid: empty; give at least one dotted params key with a list of values")
    _check_keys(source, "grid", grid, known)
    for key, values in grid.items():
        if not isinstance(values, list):
            raise SpecError(source, f"grid.{key}: expected a list of values, got {type(values).__name__} "
                                    f"{values!r} (a single value: [{values!r}] or put it under set:)")
        if not values:
            raise SpecError(source, f"grid.{key}: empty list; give at least one value")
    size = math.prod(len(values) for values in grid.values())
    if size > MAX_VARIANTS:
        raise SpecError(source, f"grid: {' x '.join(str(len(v)) for v in grid.values())} = {size} variants, "
                                f"more than the limit of {MAX_VARIANTS}; split the sweep")
    return [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]


def _listed(source: str, variants: Any, known: dict[str, Any]) -> list[dict[str, Any]]:
    if not isinstance(variants, list) or not variants:
        raise SpecError(source, "variants: expected a non-empty list of override mappings")
    out = []
    for i, item in enumerate(variants, 1):
        overrides = _mapping(source, f"variants[{i}]", item)
        _check_keys(source, f"variants[{i}]", overrides, known)
        out.append(dict(overrides))
    return out


def _with_seeds(source: str, seeds: Any, own: list[dict[str, Any]], shared: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of ``own`` once per seed (``seed`` set last): the report's spread over seeds (flows/report.py)."""
    if not isinstance(seeds, list) or not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
        raise SpecError(source, f"seeds: expected a non-empty list of integer seeds, e.g. [1, 2, 3]; got {seeds!r}")
    if "seed" in shared or any("seed" in overrides for overrides in own):
        raise SpecError(source, "seeds / seed: the seed is set in two places; keep it under seeds: only")
    return [{**overrides, "seed": seed} for overrides in own for seed in seeds]


def _check_not_shared(source: str, shared: dict[str, Any], own: list[dict[str, Any]], where: str) -> None:
    """A key the variants set must not be under ``set`` too: the variant's value would silently win."""
    for i, overrides in enumerate(own, 1):
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


def _header(source: str, data: Any, root: Path) -> tuple[str, str, int]:
    if not isinstance(data, dict):
        raise SpecError(source, "expected a mapping with name, profile and grid, variants or seeds")
    unknown = [str(k) for k in data if k not in SPEC_KEYS]
    if unknown:
        raise SpecError(source, f"{unknown[0]}: unknown key (known: {', '.join(SPEC_KEYS)})")
    for key in ("name", "profile"):
        if key not in data:
            raise SpecError(source, f"{key}: missing")
    name = data["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise SpecError(source, f"name: {name!r} is not a sweep name (letters, digits, - and _, at most 40, "
                                "starting with a letter or digit)")
    profile = data["profile"]
    try:
        check_profile(profile, root)
    except ConfigError as exc:
        raise SpecError(source, f"profile: {exc.problems[0]}") from None
    concurrency = data.get("concurrency", DEFAULT_CONCURRENCY)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise SpecError(source, f"concurrency: {concurrency!r} is not an integer from 1 to {MAX_CONCURRENCY}")
    if "grid" in data and "variants" in data or not {"grid", "variants", "seeds"} & set(data):
        raise SpecError(source, "grid / variants: give one of them (or seeds: alone: the base profile per seed)")
    return name, profile, concurrency


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
    name, profile, concurrency = _header(source, data, root)
    base = merged_profile(profile, root)
    known = flatten(base)
    shared = _mapping(source, "set", data.get("set") or {})
    _check_keys(source, "set", shared, known)
    own = _grid(source, _mapping(source, "grid", data["grid"]), known) if "grid" in data \
        else _listed(source, data["variants"], known) if "variants" in data else [{}]
    _check_not_shared(source, shared, own, "grid" if "grid" in data else "variants")
    if "seeds" in data:
        own = _with_seeds(source, data["seeds"], own, shared)
    if len(own) > MAX_VARIANTS:  # a grid's size was checked before it was expanded
        raise SpecError(source, f"{'seeds' if 'seeds' in data else 'variants'}: {len(own)} variants, more than the "
                                f"limit of {MAX_VARIANTS}; split the sweep")
    variants, seen = [], {}
    for i, overrides in enumerate(own, 1):
        variant = Variant(i, f"{name}-{i}", overrides, {**shared, **overrides})
        if variant.key in seen:
            raise SpecError(source, f"variants {seen[variant.key]} and {i} are the same ({variant.label()})")
        seen[variant.key] = i
        try:
            params = params_from_dict(variant_params(base, variant.applied), f"variant {i}")
        except ConfigError as exc:
            raise SpecError(source, f"{exc} (profile {profile} with {variant.label()})") from None
        if problems := layout_problems(section_dict(params.paths), root, profile):  # the stage's own check
            raise SpecError(source, f"variant {i}: {problems[0]} (profile {profile} with {variant.label()})")
        variants.append(variant)
    keys = tuple(dict.fromkeys(k for v in variants for k in v.overrides))
    return SweepSpec(source=source, name=name, profile=profile, concurrency=concurrency, shared=dict(shared),
                     variants=tuple(variants), keys=keys)
