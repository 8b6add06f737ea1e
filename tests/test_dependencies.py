"""Every third-party module the product imports is declared in pyproject.toml: a base dependency, an
extra's, or an import guarded by ``except ImportError``. A module that the test tools bring in but a
fresh ``pip install -e .`` does not would otherwise fail only after such an install, at the moment the code
path that imports it runs."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ["agentrl", "envs", "tools", "sandboxes", "examples"]
# modules that come with a declared dependency rather than as one of their own
BUNDLED = {"triton": "CUDA builds of torch ship it; only GPU code paths import it"}


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("_", "-")


def _guarded(tree: ast.AST) -> set[int]:
    """Line numbers of imports inside a ``try`` whose handlers catch ImportError (optional imports)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            caught = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
            if caught & {"ImportError", "ModuleNotFoundError", "(ImportError, ModuleNotFoundError)"}:
                lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if hasattr(n, "lineno")}
    return lines


def _imports(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports, optional ones left out."""
    tree = ast.parse(path.read_text())
    optional = _guarded(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_imported_module_is_a_declared_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    declared |= {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    dists = metadata.packages_distributions()
    files = [p for d in PRODUCT for p in (ROOT / d).rglob("*.py")] + [ROOT / "train_async.py"]
    undeclared: dict[str, str] = {}
    for path in files:
        for module in _imports(path) - set(sys.stdlib_module_names) - {"agentrl"} - set(BUNDLED):
            # an installed module's distributions; one not installed here is named as its extra names it
            names = {_name(d) for d in dists.get(module, [])} or {_name(module)}
            if not names & declared:
                undeclared.setdefault(module, str(path.relative_to(ROOT)))
    assert not undeclared, f"imported but not declared in pyproject.toml (module: first file): {undeclared}"
