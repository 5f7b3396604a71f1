"""Test layout: fixtures live in conftest.py, plain helpers in tests/helpers/; no module imports a test module.

A test module that imports from another (a fixture, a builder, a constant) couples the two: the
importer runs the other module's imports, an imported fixture is defined twice, and moving or
deleting one test file breaks another. Pytest finds fixtures through conftest.py by itself, and
conftest.py is loaded by pytest, not imported by tests: a constant a test needs comes from
tests/helpers/. This scans every Python file under tests/ (test modules, conftest.py files and
helpers alike)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _is_forbidden(module: str) -> bool:
    """Whether the dotted module name is a test module or a conftest (``tests.test_x``, ``conftest``)."""
    last = module.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def _package(path: Path) -> list[str]:
    """The dotted package of ``path`` (``tests/helpers/x.py`` -> ``["tests", "helpers"]``)."""
    return list(path.relative_to(REPO).parent.parts)


def forbidden_imports(source: str, path: Path) -> list[str]:
    """Every import in ``source`` (the text of ``path``) that names a test module or a conftest: ``line: module``.

    Covers ``import tests.test_x``, ``from tests.test_x import y``, ``from tests import test_x``,
    ``from tests.conftest import y``, relative forms (``from .test_x import y``, ``from . import conftest``),
    bare ``import test_x``/``import conftest`` (rootdir on sys.path), imports inside functions, and
    test modules or conftests named in ``pytest_plugins``.
    """
    problems: list[str] = []
    tree = ast.parse(source, filename=str(path))
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package(path)
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names = [module] if module and _is_forbidden(module) else []
            names += [f"{module}.{alias.name}" for alias in node.names if _is_forbidden(alias.name)]
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytest_plugins"
                                                  for t in node.targets):
            value = node.value
            items = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value]
            names = [item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)]
        problems += [f"{node.lineno}: {name}" for name in names if _is_forbidden(name)]
    return problems


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _python_files(), ids=lambda p: str(p.relative_to(TESTS)))
def test_no_module_imports_a_test_module_or_a_conftest(path: Path) -> None:
    problems = forbidden_imports(path.read_text(encoding="utf-8"), path)
    assert not problems, (
        f"{path.relative_to(REPO)} imports test modules or a conftest: {problems}. Move shared fixtures into "
        "tests/conftest.py and plain helpers or constants into tests/helpers/, and import them from there.")


def test_shared_helpers_are_not_test_modules_and_fixtures_are_in_conftest() -> None:
    helpers = TESTS / "helpers"
    assert (helpers / "__init__.py").is_file()
    for path in sorted(helpers.rglob("*.py")):
        assert not path.name.startswith("test_") and path.name != "conftest.py", path
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        fixtures = [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                    and any("fixture" in ast.unparse(d) for d in node.decorator_list)]
        assert not fixtures, f"{path.relative_to(REPO)} defines fixtures {fixtures}: they belong in a conftest.py"


@pytest.mark.parametrize(("source", "where", "expected"), [
    ("from tests.test_average import make_averaged", "tests/test_x.py", ["1: tests.test_average"]),
    ("import tests.test_train as t", "tests/test_x.py", ["1: tests.test_train"]),
    ("from tests import test_clean, helpers", "tests/test_x.py", ["1: tests.test_clean"]),
    ("from tests.conftest import SHARED", "tests/test_x.py", ["1: tests.conftest"]),
    ("from . import conftest", "tests/test_x.py", ["1: tests.conftest"]),
    ("from .test_evaluate import world", "tests/test_x.py", ["1: tests.test_evaluate"]),
    ("from ..test_audit import world", "tests/sub/test_x.py", ["1: tests.test_audit"]),
    ("import conftest", "tests/test_x.py", ["1: conftest"]),
    ("def f():\n    from tests.test_average import TINY_MODEL", "tests/test_x.py", ["2: tests.test_average"]),
    ('pytest_plugins = ("tests.test_flows",)', "tests/test_x.py", ["1: tests.test_flows"]),
    ("from tests.helpers.models import make_averaged", "tests/test_x.py", []),
    ("from tests.helpers import faultutil as fu", "tests/test_x.py", []),
    ("from . import helpers", "tests/test_x.py", []),
    ("from pipeline.testing import x\nimport pytest", "tests/test_x.py", []),
])
def test_the_scan_finds_each_kind_of_import(source: str, where: str, expected: list[str]) -> None:
    assert forbidden_imports(source, REPO / where) == expected
