"""The tree's layering, checked from the imports: what talks to any engine does not reach into the embedded
stand-in, the rollout or the trainer; the models' shared parts sit below engines and trainer; weight sync
sits above the trainer, which never imports it; the chat tokenizer sits below both rollout and engines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "agentrl"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("engine", ("agentrl.embedded", "agentrl.rollout", "agentrl.trainer")),
        ("embedded", ("agentrl.rollout", "agentrl.trainer")),
        ("trainer", ("agentrl.rollout", "agentrl.embedded", "agentrl.convert", "agentrl.weight_sync")),
        # weight sync sits above the trainer (its tensor helpers) and the engine client, below the driver
        ("weight_sync", ("agentrl.rollout", "agentrl.embedded", "agentrl.convert", "agentrl.placement")),
        # the model facts and the decoder layer that engine and trainer share sit below both
        ("models", ("agentrl.embedded", "agentrl.engine", "agentrl.rollout", "agentrl.trainer")),
    ],
)
def test_package_imports_stay_below(folder: str, forbidden: tuple[str, ...]) -> None:
    bad = {
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for path in (ROOT / folder).glob("*.py")
        for name in _imports(path)
        if name.startswith(forbidden)
    }
    assert not bad, sorted(bad)


def test_chat_tokenizer_sits_below_rollout_and_engines() -> None:
    assert not {n for n in _imports(ROOT / "chat.py") if n.startswith("agentrl")}


def test_every_package_is_installed() -> None:
    # a package missing from pyproject's list works in an editable install and is absent from a wheel
    import tomllib

    root = ROOT.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(root).parts)
        for init in ROOT.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found <= listed, sorted(found - listed)
