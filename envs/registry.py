"""The env registry: ``@register_env("name")`` on a class (or factory), ``make_env("name", **config)``.

Built-in envs register on import of :mod:`agentrl.envs`. A name may also be a ``"module:attr"`` path, so a
config can point at a user env without registering it (``env: my_pkg.envs:WordleEnv``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from .base import Env

E = TypeVar("E", bound=Callable[..., Env])
_ENVS: dict[str, Callable[..., Env]] = {}


def register_env(name: str, *, overwrite: bool = False) -> Callable[[E], E]:
    """Class/factory decorator: ``@register_env("search")``. A second different registration is an error."""

    def deco(factory: E) -> E:
        if not callable(factory):
            raise TypeError(f"env {name!r}: expected an Env subclass or factory, got {factory!r}")
        if name in _ENVS and _ENVS[name] is not factory and not overwrite:
            raise ValueError(f"env {name!r} is already registered (by {_ENVS[name]!r}); pass overwrite=True")
        _ENVS[name] = factory
        return factory

    return deco


def list_envs() -> list[str]:
    return sorted(_ENVS)


def get_env_factory(name: str) -> Callable[..., Env]:
    """The registered class/factory for ``name`` (or a ``module:attr`` path)."""
    if name in _ENVS:
        return _ENVS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise KeyError(f"cannot load env {name!r}: {err}") from None
    raise KeyError(
        f"unknown env {name!r}; known envs: {', '.join(list_envs()) or '(none)'} (or use 'module:Class')"
    )


def make_env(name: str, **config: Any) -> Env:
    """A new env instance: ``make_env("search", retrieval_url="http://127.0.0.1:8000", max_turns=3)``."""
    factory = get_env_factory(name)
    try:
        env = factory(**config)
    except TypeError as err:
        raise TypeError(f"env {name!r}: bad config {sorted(config)}: {err}") from err
    if not isinstance(env, Env):
        raise TypeError(f"env {name!r}: factory returned {type(env).__name__}, not an agentrl Env")
    return env
