"""pydantic's validation errors as this project's problem lines: one per problem, naming the dotted key
(``evaluate.beam_sizes[1]``), saying what is wrong and what to do, the user's value shown bounded (:func:`shown`: a
value in a file can be huge), at most :data:`MAX_PROBLEMS` of them."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

#: The longest rendering of a user's value in an error message (:func:`shown`).
SHOWN_CHARS = 80
#: The most problems one ConfigError lists (the rest are counted).
MAX_PROBLEMS = 30
_REPR = reprlib.Repr()  # a few items of each container, a few levels deep (Repr takes no arguments before 3.12)
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 3, 4, 4
_REPR.maxlong = _REPR.maxstring = _REPR.maxother = SHOWN_CHARS

_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
           "less_than": ("<", "lt")}
_TYPES = {"int_type": "int", "int_parsing": "int", "float_type": "float", "float_parsing": "float",
          "bool_type": "bool", "string_type": "str", "list_type": "a list", "dict_type": "a mapping",
          "model_type": "a mapping", "model_attributes_type": "a mapping"}


def _clip(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def shown(value: Any) -> str:
    """``repr(value)`` for an error message: at most :data:`SHOWN_CHARS` characters, built from a few items."""
    return _clip(_REPR.repr(value))


def _dotted(loc: tuple[Any, ...], key: bool = False) -> str:
    """``loc`` as params.yaml's users name it: ``evaluate.beam_sizes[1]`` (``key``: the last part is a key)."""
    text = ""
    for i, part in enumerate(loc):
        index = isinstance(part, int) and text and not (key and i == len(loc) - 1)
        text += f"[{part}]" if index else ("." if text else "") + _clip(str(part))
    return text


def _model_at(cls: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section model that holds the key at ``loc`` (its last element), or None."""
    for part in loc[:-1]:
        field = cls.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        cls = field.annotation
    return cls


def _unknown(cls: type[BaseModel], loc: tuple[Any, ...], moved: Mapping[str, str]) -> str:
    key, section = _dotted(loc, key=True), _model_at(cls, loc)
    known = ", ".join(section.model_fields) if section else "?"
    if key in moved:
        return (f"{key}: moved to the environment variable {moved[key]} (hardware, not a result-changing param); "
                "delete the key")
    derived: Mapping[str, str] = getattr(section, "derived", {})
    if str(loc[-1]) in derived:
        return f"{key}: not a setting (it is {derived[str(loc[-1])]}); remove it"
    if not isinstance(loc[-1], str):
        return f"{key}: unknown key, and not text (known keys here: {known})"
    return f"{key}: unknown key (known keys here: {known})"


def _line(error: Mapping[str, Any], cls: type[BaseModel], moved: Mapping[str, str]) -> str:
    loc, kind, value = tuple(error["loc"]), error["type"], error.get("input")
    key, ctx = _dotted(loc) or "params", error.get("ctx") or {}
    if kind in ("extra_forbidden", "invalid_key"):
        return _unknown(cls, loc, moved)
    if kind == "value_error":
        return f"{key}: {error['msg'].removeprefix('Value error, ')}"
    if kind in _BOUNDS:
        sign, name = _BOUNDS[kind]
        return f"{key}: {shown(value)} is out of range (expected {sign} {ctx[name]:g})"
    if kind == "too_short":
        have = "empty" if not ctx.get("actual_length") else f"{shown(value)} is too short"
        return f"{key}: {have}; give at least {ctx['min_length']} item(s)"
    if kind == "finite_number":
        return f"{key}: {shown(value)} is not a finite number"
    if kind == "literal_error":
        return f"{key}: {shown(value)} is not one of {ctx['expected']}"
    if kind in _TYPES:
        return f"{key}: expected {_TYPES[kind]}, got {type(value).__name__} {shown(value)}"
    return f"{key}: {error['msg']} (got {shown(value)})"


def problems_of(exc: ValidationError, cls: type[BaseModel], moved: Mapping[str, str], extra: list[str]) -> list[str]:
    """One line per error of ``exc`` (raised validating as ``cls``), then ``extra``, capped; ``moved`` names the
    variable that replaced a key."""
    lines = [_line(error, cls, moved) for error in exc.errors(include_url=False)
             if error["type"] != "missing"] + extra  # missing keys: ``extra`` holds them (:func:`missing_keys`)
    if len(lines) > MAX_PROBLEMS:  # a list of a million wrong items: say so once, not a million times
        lines[MAX_PROBLEMS - 1:] = [f"... and {len(lines) - MAX_PROBLEMS + 1} more problem(s) like these"]
    return lines


def missing_keys(cls: type[BaseModel], data: Any, prefix: str = "") -> list[str]:
    """``<key>: missing key`` for each field of ``cls`` (and its sections) absent from ``data``: a params file
    spells every key, so that it alone says what a run trained with (pydantic would fill in the default)."""
    if not isinstance(data, dict):
        return []
    lines = []
    for name, field in cls.model_fields.items():
        if name not in data:
            lines.append(f"{prefix}{name}: missing key")
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            lines += missing_keys(field.annotation, data[name], f"{prefix}{name}.")
    return lines
