"""Shared fixtures: tiny HF model directories built once per test session (the same code path as a real
checkpoint), and the Docker requirement switch (AGENTRL_REQUIRE_DOCKER=1 turns skips into failures)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from agentrl.models.tiny import build_tiny_model

_CACHE: dict[tuple, Path] = {}


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_model_factory(arch="qwen3", hidden_size=32)`` -> a cached HF model dir for that shape."""

    def make(arch: str = "qwen2", seed: int = 0, **shape) -> Path:
        key = (arch, seed, tuple(sorted(shape.items())))
        if key not in _CACHE:
            out = tmp_path_factory.mktemp(f"tiny_{arch}")
            _CACHE[key] = build_tiny_model(out, arch=arch, seed=seed, **shape)
        return _CACHE[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """The default tiny model: Qwen2 family, fp32, 2 layers, hidden 64, GQA 4/2 heads."""
    return tiny_model_factory("qwen2")


def docker_required() -> bool:
    """CI sets AGENTRL_REQUIRE_DOCKER=1: then a missing Docker engine is a failure, not a skip."""
    return os.environ.get("AGENTRL_REQUIRE_DOCKER", "") not in ("", "0", "false")
