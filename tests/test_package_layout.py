"""The package's layers: imports run one way, down the stack, every package imports on its own, and no module grows
past what a reader takes in at once."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxstation"
# bottom to top: a module may import only from its own layer and those before it
LAYERS = ("kernels", "model", "engine", "serving", "openai", "app", "mesh", "cli")
MAX_LINES = 450


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_run_down_the_stack(path: Path) -> None:
    here = _layer(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxstation."):
            there = _layer(node.module)
            assert LAYERS.index(there) <= LAYERS.index(here), f"{path.name} ({here}) imports {node.module} ({there})"


@pytest.mark.parametrize("package", ["kernels", "model", "engine", "serving", "openai", "mesh", "app", "cli"])
def test_each_package_imports_alone(package: str) -> None:
    assert importlib.import_module(f"jaxstation.{package}")


def test_no_module_over_the_limit() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
