"""dvc.yaml's code deps are exactly what each stage runs, so a code change always reruns its stages.

For every stage the test starts from the module its ``cmd`` runs (``python -m pipeline.X``), follows
project imports transitively (a package's lazy ``_LAZY`` exports resolved to their modules; imports
under ``if TYPE_CHECKING:`` never run), adds modules started by name (``["-m", "pipeline.train"]`` in
a command line, as the launcher builds) and the packages copied into the MLflow model
(``CODE_PACKAGES`` of the module that copies them), and compares the files reached with the stage's deps: every file reached
must be covered by a dep, every file dep must be reached, and a folder dep must be reached whole
(otherwise it reruns the stage for files it never runs). Empty ``__init__.py`` files are left out:
they run no code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import REPO

PACKAGES = ("pipeline", "model", "flows")
_MODULE_NAME = re.compile(r"^(?:pipeline|model)(?:\.\w+)*$")


def module_file(name: str, repo: Path = REPO) -> Path | None:
    """The file of project module ``name`` (a package's ``__init__.py``), or None."""
    base = repo.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except what sits under ``if TYPE_CHECKING:`` (never run)."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _lazy_exports(package: str, repo: Path) -> dict[str, str]:
    """A package's ``_LAZY`` table (public name -> defining module; PEP 562 ``__getattr__``), if any."""
    init = repo.joinpath(*package.split("."), "__init__.py")
    if not init.is_file():
        return {}
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets):
                return ast.literal_eval(node.value)
    return {}


def _started_by_name(node: ast.AST) -> set[str]:
    """Modules a list or tuple literal starts with ``-m NAME`` (a subprocess command line)."""
    if not isinstance(node, (ast.List, ast.Tuple)):
        return set()
    elts = node.elts
    return {b.value for a, b in zip(elts, elts[1:])
            if isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant)
            and isinstance(b.value, str) and _MODULE_NAME.match(b.value)}


def _referenced_modules(path: Path, repo: Path) -> set[str]:
    """Project modules that ``path`` imports, starts with ``-m``, or copies whole (``CODE_PACKAGES``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in _nodes(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            lazy = _lazy_exports(node.module, repo)
            names.update(lazy.get(alias.name, f"{node.module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CODE_PACKAGES"
                                                  for t in node.targets):
            names.update(f"{pkg}.*" for pkg in ast.literal_eval(node.value))
        names |= _started_by_name(node)
    out = set()
    for name in names:
        if name.split(".")[0] not in PACKAGES:
            continue
        if name.endswith(".*"):
            out.update(_package_modules(name[:-2], repo))
            continue
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))  # parents run their __init__
    return {n for n in out if module_file(n, repo) is not None}


def _package_modules(package: str, repo: Path) -> set[str]:
    root = repo / package
    return {".".join(p.relative_to(repo).with_suffix("").parts).removesuffix(".__init__")
            for p in root.rglob("*.py")}


def reached_files(root_module: str, repo: Path = REPO) -> set[Path]:
    """Every project file that running ``python -m root_module`` may execute (empty ``__init__`` left out)."""
    seen: set[str] = set()
    todo = [root_module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name, repo)
        if path is not None:
            todo.extend(_referenced_modules(path, repo) - seen)
    files = {module_file(n, repo) for n in seen}
    return {f.relative_to(repo) for f in files if f is not None
            and not (f.name == "__init__.py" and not f.read_text(encoding="utf-8").strip())}


def _stages(repo: Path = REPO) -> dict:
    return yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


def _cmd_module(cmd: str) -> str:
    match = re.match(r"python -m ([\w.]+)", cmd)
    assert match, f"dvc.yaml cmd {cmd!r} is not `python -m MODULE`"
    return match.group(1)


def lineage_problems(stage: dict, repo: Path = REPO) -> list[str]:
    """What is wrong with one stage's code deps (empty when they are exact)."""
    reached = reached_files(_cmd_module(stage["cmd"]), repo)
    code_deps = [Path(d) for d in stage.get("deps", []) if "${" not in d and Path(d).parts[0] in PACKAGES]
    problems = []
    for dep in code_deps:
        if (repo / dep).is_dir():
            unused = sorted(str(f.relative_to(repo)) for f in (repo / dep).rglob("*.py")
                            if f.relative_to(repo) not in reached
                            and not (f.name == "__init__.py" and not f.read_text(encoding="utf-8").strip()))
            if unused:
                problems.append(f"{dep}/ is a dep but the stage never runs {', '.join(unused)}: list files instead")
        elif dep not in reached:
            problems.append(f"{dep} is a dep but the stage never imports it")
    for f in sorted(reached):
        if not any(f == d or d in f.parents for d in code_deps):
            problems.append(f"{f} runs in the stage but is not a dep")
    return problems


@pytest.mark.parametrize("name", list(_stages()))
def test_code_deps_are_exactly_what_the_stage_runs(name: str) -> None:
    problems = lineage_problems(_stages()[name])
    assert not problems, f"dvc.yaml stage {name}:\n  " + "\n  ".join(problems)


def test_a_missing_dep_is_caught() -> None:
    stage = _stages()["clean"]
    removed = next(d for d in stage["deps"] if d.startswith("pipeline/") and d != "pipeline/clean.py")
    broken = {**stage, "deps": [d for d in stage["deps"] if d != removed]}
    assert any("is not a dep" in p for p in lineage_problems(broken)), removed


def test_an_unused_dep_is_caught() -> None:
    stage = _stages()["clean"]
    broken = {**stage, "deps": [*stage["deps"], "pipeline/inference/scoring.py", "pipeline/training"]}
    problems = lineage_problems(broken)
    assert any("scoring.py is a dep but the stage never imports it" in p for p in problems), problems
    assert any(p.startswith("pipeline/training/ is a dep") for p in problems), problems


def test_modules_started_by_name_are_followed() -> None:
    reached = reached_files("pipeline.launch")
    assert Path("pipeline/train.py") in reached  # torchrun ... -m pipeline.train
    assert Path("pipeline/training/loop.py") in reached


def _params_keys(data: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= _params_keys(value, f"{prefix}{key}.")
    return keys


@pytest.mark.parametrize("name", list(_stages()))
def test_params_keys_exist(name: str) -> None:
    keys = _params_keys(yaml.safe_load((REPO / "profiles" / "paper.yaml").read_text(encoding="utf-8")))
    for entry in _stages()[name].get("params", []):
        names = [k for k in entry] if isinstance(entry, dict) else [entry]
        for key in names:
            if key.endswith(".yaml"):  # a whole params file
                assert (REPO / key).is_file(), f"dvc.yaml stage {name}: params file {key} does not exist"
                continue
            assert key in keys, f"dvc.yaml stage {name}: params key {key!r} is not in params.yaml"


def test_dvc_yaml_follows_the_stage_table() -> None:
    """Same stages in the same order, each running its table module, with its details file as an out and
    its ``<stage>.json`` as its one DVC metric exactly when the table names metrics keys for it."""
    from pipeline.core import stages

    dvc = _stages()
    assert list(dvc) == list(stages.NAMES)
    for spec in stages.STAGES:
        entry = dvc[spec.name]
        assert _cmd_module(entry["cmd"]) == spec.module, spec.name
        metrics = [next(iter(m)) if isinstance(m, dict) else m for m in entry.get("metrics", [])]
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in entry.get("outs", [])]
        expected = [str(stages.metrics_file("${paths.metrics}", spec.name))] if spec.metrics else []
        assert metrics == expected, spec.name
        assert all(isinstance(m, str) for m in entry.get("metrics", [])), spec.name  # cached: the run cache carries it
        assert str(stages.details_file("${paths.metrics}", spec.name)) in outs, spec.name
        params = [next(iter(p)) if isinstance(p, dict) else p for p in entry.get("params", [])]
        for section in spec.sections:  # the sections its MLflow run logs are the ones DVC tracks
            assert section in params, (spec.name, section)
