"""A frozen dataclass built from a parsed YAML mapping, strictly: every unknown, missing, mistyped or out-of-range
key reported together, one line each, values shown bounded (:func:`shown`: a value in a file can be huge)."""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from model.config import DERIVED
from pipeline.core.errors import ConfigError

#: The longest rendering of a user's value in an error message (:func:`shown`).
SHOWN_CHARS = 80
#: The most problems one :class:`ConfigError` lists (the rest are counted).
MAX_PROBLEMS = 30
_REPR = reprlib.Repr()  # a few items of each container, a few levels deep (Repr takes no arguments before 3.12)
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 3, 4, 4
_REPR.maxlong = _REPR.maxstring = _REPR.maxother = SHOWN_CHARS

#: ``(class, field name, type-correct value) -> [(item suffix such as "[2]" or "", problem)]``.
KeyRules = Callable[[type, str, Any], list[tuple[str, str]]]


def _clip(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def shown(value: Any) -> str:
    """``repr(value)`` for an error message: at most :data:`SHOWN_CHARS` characters, built from a few items."""
    return _clip(_REPR.repr(value))


def _key_text(key: Any) -> str:
    return _clip(str(key)) if isinstance(key, (str, int)) else shown(key)


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


def build(cls: type, data: Any, source: str, *, rules: KeyRules, moved: Mapping[str, str]) -> Any:
    """Build dataclass ``cls`` from mapping ``data`` read from ``source`` (every key required), checking ``rules``
    on each well-typed key; ``moved`` names the variable that replaced a key.

    Raises:
        ConfigError: one line per problem (at most :data:`MAX_PROBLEMS`, the rest counted).
    """
    builder = _Builder(rules, moved)
    obj = builder.dataclass(cls, data, "")
    errors = builder.errors
    if len(errors) > MAX_PROBLEMS:  # a list of a million wrong items: say so once, not a million times
        errors[MAX_PROBLEMS - 1:] = [f"... and {len(errors) - MAX_PROBLEMS + 1} more problem(s) like these"]
    if errors or obj is None:
        raise ConfigError(source, errors or ["invalid configuration"])
    return obj


class _Builder:
    """One :func:`build`: its rules and the problems found so far."""

    def __init__(self, rules: KeyRules, moved: Mapping[str, str]) -> None:
        self.rules, self.moved, self.errors = rules, moved, []

    def value(self, value: Any, tp: Any, key: str) -> Any:
        """Check ``value`` against annotation ``tp``; note an error naming ``key`` on mismatch."""
        origin = typing.get_origin(tp)
        if dataclasses.is_dataclass(tp):
            return self.dataclass(tp, value, key)
        if origin is Literal:
            if value not in typing.get_args(tp):
                self.errors.append(f"{key}: {shown(value)} is not one of {list(typing.get_args(tp))}")
            return value
        if origin in (typing.Union, types.UnionType):
            args = typing.get_args(tp)
            if value is None and type(None) in args:
                return None
            return self.value(value, [a for a in args if a is not type(None)][0], key)
        if origin in (list, dict):
            if not isinstance(value, origin):
                what = "a list" if origin is list else "a mapping"
                self.errors.append(f"{key}: expected {what}, got {type(value).__name__} {shown(value)}")
                return value
            item_tp = typing.get_args(tp)[-1]
            if origin is list:
                return [self.value(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
            return {str(k): self.value(v, item_tp, f"{key}.{_key_text(k)}") for k, v in value.items()}
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if tp in (int, float) and isinstance(value, bool) or not isinstance(value, tp):
            name = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
            self.errors.append(f"{key}: expected {name}, got {type(value).__name__} {shown(value)}")
        return value

    def dataclass(self, cls: type, data: Any, prefix: str) -> Any:
        """Build dataclass ``cls`` from mapping ``data``, noting every problem."""
        where = prefix or "params"
        if not isinstance(data, dict):
            self.errors.append(f"{where}: expected a mapping, got {type(data).__name__}")
            return None
        hints = typing.get_type_hints(cls)
        every = {f.name: f for f in dataclasses.fields(cls)}
        fields = {name: f for name, f in every.items() if DERIVED not in f.metadata}
        dotted = (prefix + ".") if prefix else ""
        for key in sorted(set(data) - set(fields), key=str):
            if not isinstance(key, str):
                self.errors.append(f"{dotted}{_key_text(key)}: unknown key, and not text (known keys here: "
                                   f"{', '.join(fields)})")
            elif dotted + key in self.moved:
                self.errors.append(f"{dotted}{key}: moved to the environment variable {self.moved[dotted + key]} "
                                   "(hardware, not a result-changing param); delete the key")
            elif key in every:
                self.errors.append(f"{dotted}{key}: not a setting (it is {every[key].metadata[DERIVED]}); remove it")
            else:
                self.errors.append(f"{dotted}{_key_text(key)}: unknown key (known keys here: {', '.join(fields)})")
        kwargs: dict[str, Any] = {}
        n_before = len(self.errors)
        for name in fields:
            if name not in data:
                self.errors.append(f"{dotted}{name}: missing key")
                continue
            n_key = len(self.errors)
            kwargs[name] = self.value(data[name], hints[name], f"{dotted}{name}")
            if len(self.errors) == n_key:  # the type is right: now the key's own rules
                self.errors.extend(f"{dotted}{name}{item}: {problem}" for item, problem in self.rules(cls, name,
                                                                                                        kwargs[name]))
        if len(self.errors) > n_before:
            return None
        try:
            return cls(**kwargs)
        except ValueError as exc:  # cross-field rules from __post_init__
            self.errors.append(f"{where}: {exc}")
            return None
