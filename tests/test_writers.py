"""One rule decides what any command may replace or delete: pipeline/core/owned.py is the only module that calls
``rmtree``, ``unlink``, ``replace``, ``rename``, ``remove``, ``rmdir`` or ``move``; every other writer goes through it.

This scans every Python file of model/, pipeline/, flows/ and benchmarks/ (calls inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import REPO

#: The home of the rule (its docstring states it; docs/reliability.md repeats it).
RULE = REPO / "pipeline" / "core" / "owned.py"
CODE = ("model", "pipeline", "flows", "benchmarks")
#: ``os.*`` / ``shutil.*`` calls that delete or move a file system entry.
MODULE_CALLS = {("os", "remove"), ("os", "unlink"), ("os", "rmdir"), ("os", "removedirs"), ("os", "rename"),
                ("os", "renames"), ("os", "replace"), ("shutil", "rmtree"), ("shutil", "move")}
#: Methods of ``pathlib.Path`` that do, by the positional arguments they take (``str.replace`` takes two,
#: ``Path.replace`` one; ``dataclasses.replace`` takes keywords).
PATH_METHODS = {"unlink": (0, 1), "rmdir": (0,), "rename": (1,), "replace": (1,)}


def writers(source: str, path: Path) -> list[str]:
    """``<line>: <call>`` for every call in ``source`` that deletes, renames or replaces a file system entry."""
    found = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name, owner = node.func.attr, node.func.value
        if isinstance(owner, ast.Name) and (owner.id, name) in MODULE_CALLS:
            found.append(f"{node.lineno}: {owner.id}.{name}")
        elif name in PATH_METHODS and len(node.args) in PATH_METHODS[name] and (
                name == "unlink" or not node.keywords):
            found.append(f"{node.lineno}: .{name}()")
    return found


def test_only_the_rule_module_deletes_renames_or_replaces() -> None:
    offenders = {str(path.relative_to(REPO)): calls for folder in CODE for path in sorted((REPO / folder).rglob("*.py"))
                 if path != RULE and (calls := writers(path.read_text(encoding="utf-8"), path))}
    assert offenders == {}, "use pipeline/core/owned.py (atomic_path, retire, discard, ...) instead"


def test_the_scan_finds_each_kind_of_writer() -> None:
    source = ("import os, shutil\nos.replace(a, b)\nshutil.rmtree(p)\np.unlink(missing_ok=True)\np.rename(q)\n"
              "p.replace(q)\nos.remove(p)\np.rmdir()\ns.replace('a', 'b')\nd.pop(k)\n")
    assert writers(source, Path("x.py")) == ["2: os.replace", "3: shutil.rmtree", "4: .unlink()", "5: .rename()",
                                             "6: .replace()", "7: os.remove", "8: .rmdir()"]
    assert writers(RULE.read_text(encoding="utf-8"), RULE), "the rule module itself deletes and renames"
