"""Modules that moved: importing one by its old name fails with a one-line pointer to the new name
(``python -m agentrl.engine.embedded_server`` and its import still work through a small alias module)."""

from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "agentrl.engine.embedded": "agentrl.embedded.engine",
    "agentrl.engine.native_api": "agentrl.embedded.native_api",
    "agentrl.engine.runner": "agentrl.embedded.runner",
    "agentrl.engine.scheduler": "agentrl.embedded.scheduler",
    "agentrl.engine.request": "agentrl.embedded.request",
    "agentrl.engine.sampling": "agentrl.embedded.sampling",
    "agentrl.engine.prefix_cache": "agentrl.embedded.prefix_cache",
    "agentrl.engine.weights": "agentrl.embedded.weights",
    "agentrl.rollout.tokenize": "agentrl.chat",
}


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Asked last, so only for names no real module answers: a moved module's old name."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name in MOVED:
            raise ModuleNotFoundError(f"{name} moved: import {MOVED[name]} instead", name=name)
        return None


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
