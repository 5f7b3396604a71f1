"""Imports point one way (README, Layout): flows -> (subprocess) dvc -> pipeline -> model -> torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.paths import REPO


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _top(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


@pytest.mark.parametrize("path", _modules("model"), ids=lambda p: p.name)
def test_model_knows_nothing_of_files_ranks_or_tracking(path: Path) -> None:
    names = _imports(path)
    banned = {"pipeline", "flows", "mlflow", "dvc", "prefect", "pyarrow", "sentencepiece", "os", "pathlib"}
    assert not (_top(names) & banned), f"{path}: imports {_top(names) & banned}"
    assert not any(n.startswith("torch.distributed") for n in names), path


#: The modules that may import torch.distributed: the ranks' process group and torchrun's agent.
DISTRIBUTED = {"pipeline/training/distributed.py", "pipeline/training/agent.py"}
#: MLflow's one home: runs, logged and registered models, the pyfunc MLflow loads and the scoring app.
TRACKING = "pipeline/tracking/"


@pytest.mark.parametrize("path", _modules("pipeline"), ids=lambda p: p.name)
def test_only_distributed_touches_torch_distributed_and_nothing_prefect(path: Path) -> None:
    names = _imports(path)
    if path.relative_to(REPO).as_posix() not in DISTRIBUTED:
        assert not any(n.startswith("torch.distributed") for n in names), f"{path} imports torch.distributed"
    assert not (_top(names) & {"flows", "prefect"}), f"{path} imports flows/prefect"


@pytest.mark.parametrize("path", [p for package in ("model", "pipeline", "flows", "benchmarks")
                                  for p in _modules(package)], ids=lambda p: str(p.relative_to(REPO)))
def test_every_mlflow_import_is_under_pipeline_tracking(path: Path) -> None:
    if not path.relative_to(REPO).as_posix().startswith(TRACKING):
        assert "mlflow" not in _top(_imports(path)), f"{path.relative_to(REPO)} imports mlflow: MLflow calls " \
                                                     f"belong in {TRACKING}"


@pytest.mark.parametrize("path", ["pipeline/tracking/store.py", "pipeline/tracking/runs.py",
                                  "pipeline/tracking/model_registry.py"])
def test_tracking_imports_no_torch(path: str) -> None:
    assert "torch" not in _top(_imports(REPO / path))


@pytest.mark.parametrize("path", _modules("flows"), ids=lambda p: p.name)
def test_flows_never_import_torch_or_model(path: Path) -> None:
    names = _top(_imports(path))
    assert not (names & {"torch", "model"}), f"{path} imports {names & {'torch', 'model'}}"


# --- subpackages and cycles --------------------------------------------------------------------------

#: What each subpackage of pipeline/ may import (besides itself); the stage entry points and cli.py at
#: the top of pipeline/ may import any of them. core reads params into model.config's TransformerConfig; tracking
#: logs the models inference loads.
ALLOWED = {
    "core": {"model"},
    "artifacts": {"core", "model"},
    "data": {"core"},
    "training": {"artifacts", "core", "data", "model", "tracking"},
    "inference": {"artifacts", "core", "data", "model"},
    "tracking": {"artifacts", "core", "inference", "model"},
    "auditing": {"artifacts", "core", "inference", "model"},
    "project": {"core"},
}


def _runtime_imports(path: Path, *, type_checking: bool = False) -> set[str]:
    """Project modules ``path`` imports (module or function level); ``if TYPE_CHECKING:`` imports only when
    ``type_checking`` (they never run, but a cycle through them is still a cycle in the design)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                and not type_checking):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        todo.extend(ast.iter_child_nodes(node))
    return {n for n in names if n.split(".")[0] in ("pipeline", "model", "flows") and _module_path(n) is not None}


def _module_path(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


@pytest.mark.parametrize("path", _modules("pipeline"), ids=lambda p: str(p.relative_to(REPO)))
def test_subpackages_import_only_what_they_may(path: Path) -> None:
    parts = path.relative_to(REPO / "pipeline").parts
    if len(parts) == 1:
        return  # a stage entry point or cli.py
    own = parts[0]
    for name in _runtime_imports(path):
        pieces = name.split(".")
        target = "model" if pieces[0] == "model" else pieces[1] if len(pieces) > 1 else "pipeline"
        if target in (own, "pipeline"):
            continue
        assert target in ALLOWED[own], f"{path.relative_to(REPO)} imports {name}: pipeline/{own} may import " \
                                       f"only {sorted(ALLOWED[own])}"
        assert not (pieces[0] == "pipeline" and len(pieces) == 2 and (REPO / "pipeline" / f"{pieces[1]}.py").is_file()), \
            f"{path.relative_to(REPO)} imports the stage entry point {name}"


_STAGE_MODULES = sorted(p for p in (REPO / "pipeline").glob("*.py") if p.name not in ("__init__.py", "cli.py"))


@pytest.mark.parametrize("path", _STAGE_MODULES, ids=lambda p: p.name)
def test_no_stage_module_imports_another(path: Path) -> None:
    others = {f"pipeline.{p.stem}" for p in _STAGE_MODULES if p != path}
    found = sorted(others & _runtime_imports(path, type_checking=True))
    assert not found, f"{path.relative_to(REPO)} imports the stage module(s) {found}: what stages share belongs " \
                      "in a subpackage (pipeline/artifacts/ for file formats)"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (module -> modules it imports) as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ()) - {node}):  # a module importing itself by name is no cycle
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [module])):
            return found
    return None


def test_no_module_imports_another_in_a_cycle() -> None:
    graph = {_module_name(p): {n for n in _runtime_imports(p, type_checking=True) if p.name != "__init__.py" or
                               not n.startswith(_module_name(p) + ".")}
             for package in ("pipeline", "model", "flows") for p in _modules(package)}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a", "b"}, "b": set()}) is None
