"""The env registry: ``@register_env("name")`` on a class (or factory), ``make_env("name", **config)``.

Built-in envs register on import of :mod:`agentrl.envs`. A name may also be a ``"module:attr"`` path, so a
config can point at a user env without registering it (``env: my_pkg.envs:WordleEnv``). An ``async def``
agent function (``agent(task, client) -> float | None``) is wrapped in an :class:`~.agent.AgentEnv`. The rules
(overwrite checks, errors listing known names) are :class:`agentrl.registry.Registry`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from agentrl.registry import Registry

from .agent import AgentEnv, is_agent
from .base import Env

E = TypeVar("E", bound=Callable[..., Env])
ENVS: Registry[Callable[..., Env]] = Registry("env")


def register_env(name: str, *, overwrite: bool = False) -> Callable[[E], E]:
    """Class/factory decorator: ``@register_env("search")``. A second different registration is an error."""
    return ENVS.register(name, overwrite=overwrite)


def list_envs() -> list[str]:
    return ENVS.names()


def get_env_factory(name: str) -> Callable[..., Env]:
    """The registered class/factory for ``name`` (or a ``module:attr`` path)."""
    return ENVS.get(name)


def make_env(name: str, **config: Any) -> Env:
    """A new env instance: ``make_env("search", retrieval_url="http://127.0.0.1:8000", max_turns=3)``."""
    factory = get_env_factory(name)
    if is_agent(factory):
        return AgentEnv(factory, **config)
    try:
        env = factory(**config)
    except TypeError as err:
        raise TypeError(f"env {name!r}: bad config {sorted(config)}: {err}") from err
    if not isinstance(env, Env):
        raise TypeError(f"env {name!r}: factory returned {type(env).__name__}, not an agentrl Env")
    return env
