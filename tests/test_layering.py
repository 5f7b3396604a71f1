"""Imports point one way (README, Layout): flows -> (subprocess) dvc -> pipeline -> model -> torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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


@pytest.mark.parametrize("path", _modules("pipeline"), ids=lambda p: p.name)
def test_only_distributed_and_tracking_touch_their_libraries(path: Path) -> None:
    names = _imports(path)
    if path.name != "distributed.py":
        assert not any(n.startswith("torch.distributed") for n in names), f"{path} imports torch.distributed"
    if path.name not in ("tracking.py", "mlflow_model.py"):  # mlflow_model.py is the pyfunc MLflow loads
        assert "mlflow" not in _top(names), f"{path} imports mlflow"
    assert not (_top(names) & {"flows", "prefect"}), f"{path} imports flows/prefect"


def test_tracking_imports_no_torch() -> None:
    assert "torch" not in _top(_imports(REPO / "pipeline" / "core" / "tracking.py"))


@pytest.mark.parametrize("path", _modules("flows"), ids=lambda p: p.name)
def test_flows_never_import_torch_or_model(path: Path) -> None:
    names = _top(_imports(path))
    assert not (names & {"torch", "model"}), f"{path} imports {names & {'torch', 'model'}}"
