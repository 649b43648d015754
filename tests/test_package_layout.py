"""The package's layers: imports run one way, down the stack, every package imports on its own, and no module grows
past what a reader takes in at once."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxstation"
# bottom to top: a module may import only from its own layer and those before it
LAYERS = ("kernels", "model", "engine", "config", "server", "group", "chat", "openai", "anthropic", "offline", "app",
          "mesh", "cli")
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


@pytest.mark.parametrize("package", ["kernels", "model", "engine", "config", "server", "server.web", "chat", "openai",
                                     "anthropic", "offline", "app", "group", "mesh", "cli"])
def test_each_package_imports_alone(package: str) -> None:
    assert importlib.import_module(f"jaxstation.{package}")


def _resolve(path: Path, node: ast.AST) -> list[str]:
    """The absolute names an import statement in `path` imports (a module, or a module and each name from it),
    relative imports resolved as Python does; [] for any other statement."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    package = list(path.relative_to(PACKAGE.parent).parent.parts)
    module = ".".join((package[:len(package) - node.level + 1] if node.level else []) + [node.module or ""])
    module = module.rstrip(".")
    return [module] + [f"{module}.{a.name}" for a in node.names]


def _imported(path: Path) -> list[str]:
    return [name for node in ast.walk(ast.parse(path.read_text())) for name in _resolve(path, node)]


@pytest.mark.parametrize("face, other", [("anthropic", "openai"), ("openai", "anthropic")])
def test_one_api_face_never_imports_another(face: str, other: str) -> None:
    """Each face translates onto the chat layer below it: neither imports the other, in any form of import."""
    found = [f"{path.name}: {name}" for path in sorted((PACKAGE / face).rglob("*.py")) for name in _imported(path)
             if name == f"jaxstation.{other}" or name.startswith(f"jaxstation.{other}.")]
    assert not found, found


def test_imports_are_resolved_as_python_does() -> None:
    """The check above sees relative imports and `from jaxstation import openai` too."""
    probe = PACKAGE / "anthropic" / "probe.py"
    tree = "from ..openai import routes\nfrom . import protocol\nfrom jaxstation import openai\nimport jaxstation.x\n"
    names = set()
    for node in ast.parse(tree).body:
        names.update(_resolve(probe, node))
    assert names >= {"jaxstation.openai", "jaxstation.openai.routes", "jaxstation.anthropic.protocol",
                     "jaxstation.x"}


def test_no_module_over_the_limit() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


ROOT = PACKAGE.parent
RUN_DIRECTLY = re.compile(r"(?<![\w/.])(?<!python )(?<!python3 )(?<!bash )(scripts/[\w/-]+\.(?:sh|py))")


def _scripts_the_docs_run() -> set[str]:
    """Every `scripts/...` path the README and docs/ write as a command of its own (not after python or bash)."""
    found = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in doc.read_text().splitlines():
            found.update(m.group(1) for m in RUN_DIRECTLY.finditer(line.lstrip("`$ ")))
    return found


def test_every_script_the_docs_run_is_executable_in_git() -> None:
    """A fresh clone keeps git's modes: a script the docs run as `scripts/x.sh` must be committed with its run bit."""
    listing = subprocess.run(["git", "ls-files", "-s", "scripts"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout  # "<mode> <object> <stage>\t<path>" a line
    modes = {line.split()[3]: line.split()[0] for line in listing.splitlines()}
    run = _scripts_the_docs_run() | {f"scripts/{p.name}" for p in (ROOT / "scripts").glob("*.sh")}
    assert run >= {"scripts/build_image_local.sh", "scripts/deploy_cloudrun.sh", "scripts/gpu_check.sh"}
    assert {s: modes.get(s) for s in sorted(run) if modes.get(s) != "100755"} == {}


def test_no_function_over_80_lines() -> None:
    """Functions do one job: none past 80 lines (the CPU kernels' C++ is not Python and not counted)."""
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                long[f"{path.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long
