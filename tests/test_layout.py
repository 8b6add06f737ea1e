"""The tree's layering, checked from the imports: what talks to any engine does not reach into the embedded
stand-in, the rollout or the trainer; the chat tokenizer sits below both rollout and engines; moved modules
fail with a pointer to their new name; the old server command still starts the embedded server."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl._moved import MOVED

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
        ("trainer", ("agentrl.rollout", "agentrl.embedded", "agentrl.convert")),
    ],
)
def test_package_imports_stay_below(folder: str, forbidden: tuple[str, ...]) -> None:
    bad = {
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for path in (ROOT / folder).glob("*.py")
        for name in _imports(path)
        if name.startswith(forbidden) and not path.name == "embedded_server.py"  # the alias module
    }
    assert not bad, sorted(bad)


def test_chat_tokenizer_sits_below_rollout_and_engines() -> None:
    assert not {n for n in _imports(ROOT / "chat.py") if n.startswith("agentrl")}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_moved_module_names_point_to_the_new_one(old: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=f"{old} moved: import {MOVED[old]} instead"):
        importlib.import_module(old)
    importlib.import_module(MOVED[old])


def test_old_server_command_still_starts_the_embedded_server() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.engine.embedded_server", "--help"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "--model" in out.stdout
    from agentrl.embedded.server import start_embedded_server
    from agentrl.engine.embedded_server import start_embedded_server as alias

    assert alias is start_embedded_server
