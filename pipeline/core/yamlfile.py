"""Reading a YAML file that a person writes (params, profiles, sweep specs, prefect.yaml), bounded: a few
kilobytes of nested aliases expand into billions of items, so anchors, aliases and big files are refused.

DVC reads params.yaml too (ruamel.yaml, YAML 1.2: ``dvc/utils/serialize/_yaml.py``), so this loader reads what
DVC reads where the two would differ on a number: a duplicate key is refused, as DVC refuses it, and YAML 1.1's
base-60 numbers (``1:20`` = 80) are not numbers, as in YAML 1.2."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.errors import ConfigError

#: A value as a parsed YAML or JSON file holds it.
Plain = str | int | float | bool | None | list["Plain"] | dict[str, "Plain"]
#: A parsed YAML mapping or JSON object (params.yaml, a profile, a section of one).
PlainMapping = dict[str, Plain]
#: The largest YAML file read (the paper profile is about 4 KB; a sweep spec, prefect.yaml: a few KB).
MAX_BYTES = 1 << 20


class _Refused(yaml.MarkedYAMLError):
    """Valid YAML that this loader does not accept (an anchor or alias)."""


class _NoAnchorLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that stops at the first anchor (``&name``) or alias (``*name``) or duplicate key."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise _Refused(problem=f"YAML anchors and aliases are not accepted (found "
                                   f"{sign}{_clip(str(event.anchor), 40)}); write the value out in full",
                           problem_mark=event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if not isinstance(key := self.construct_object(key_node, deep=True), (str, int, float)):
                continue  # a list or mapping as a key: SafeLoader refuses it itself
            if key in first:
                raise _Refused(problem=f"duplicate key {_clip(str(key), 40)!r} (first on line "
                                       f"{first[key].start_mark.line + 1}); DVC refuses such a file: keep one",
                               problem_mark=key_node.start_mark)
            first[key] = key_node
        return super().construct_mapping(node, deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except ValueError as exc:  # int() past its digit limit, a date like 2024-13-45: name the line
            reason = str(exc).split(";", 1)[0]
            raise yaml.constructor.ConstructorError(problem=f"cannot read this value ({_clip(reason, 100)})",
                                                    problem_mark=node.start_mark) from None


_NUMBERS = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
_NoAnchorLoader.yaml_implicit_resolvers = {  # SafeLoader's, less its int and float rules (added back below)
    first: [(tag, regex) for tag, regex in rules if tag not in _NUMBERS]
    for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}
# PyYAML's own int and float patterns (yaml/resolver.py) without their base-60 alternatives.
_NoAnchorLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(
    r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
_NoAnchorLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _where(exc: yaml.YAMLError, text: str) -> str:
    """``line L, column C: `` of a YAML error in ``text``, if PyYAML gave a position."""
    if (mark := getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)) is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: "
    if isinstance(position := getattr(exc, "position", None), int):  # a character PyYAML cannot read
        before = text[:position]
        return f"line {before.count(chr(10)) + 1}, column {position - before.rfind(chr(10))}: "
    return ""


def _problem(exc: yaml.YAMLError) -> str:
    """The YAML error's reason on one line (PyYAML's own text spans several, with a snippet)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        text = ": ".join(p for p in (exc.context, exc.problem) if p)
    else:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return _clip(" ".join(text.split()), 200)


def load_yaml(path: str | Path, *, max_bytes: int = MAX_BYTES) -> Any:
    """Parse the YAML file ``path`` (None when empty), refusing anchors, aliases and files over ``max_bytes``.

    Raises:
        OSError: ``path`` cannot be read (FileNotFoundError: each caller says what to do about it).
        ConfigError: too large, not UTF-8, not valid YAML, or with an anchor or alias (names file, line, column).
    """
    path = Path(path)
    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ConfigError(str(path), [f"larger than {max_bytes} bytes, far more than a YAML settings file needs; "
                                      "check that this is the file you meant"])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"invalid UTF-8 at byte {exc.start}; re-encode the file as UTF-8"]) from None
    try:
        return yaml.load(text, Loader=_NoAnchorLoader)  # a SafeLoader subclass
    except RecursionError:
        raise ConfigError(str(path), ["not valid YAML: lists or mappings nested too deeply; "
                                      "check that this is the file you meant"]) from None
    except yaml.YAMLError as exc:
        if isinstance(exc, _Refused):
            raise ConfigError(str(path), [f"{_where(exc, text)}{exc.problem}"]) from None
        problem = f"{_where(exc, text)}not valid YAML: {_problem(exc)}; fix the file there"
        raise ConfigError(str(path), [problem]) from None
