"""The verifier contract and registry.

A verifier is ``async def my_verifier(trajectory, label) -> float | RewardResult``, registered with
``@register_verifier("name")``. It reads the whole :class:`~agentrl.types.Trajectory`: the model's text
(``assistant_text()``), the env's final answer (``final_answer``) and the tool calls the env ran with their
results (``tool_results()``). A ``RewardResult``'s parts are logged per training batch as ``reward/<part>``.
:func:`run_verifier` is the one way the rollout calls it: a verifier that raises, times out or returns a
non-number marks the trajectory FAILED with that error; it never becomes a silent 0.0 reward.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.config import ConfigError
from agentrl.registry import Registry
from agentrl.types import Status, Trajectory


@dataclass
class RewardResult:
    """A reward with optional named parts (logged as ``reward/<part>``)."""

    reward: float
    parts: dict[str, float] = field(default_factory=dict)


Verifier = Callable[[Trajectory, Any], Awaitable[float | RewardResult] | float | RewardResult]

VERIFIERS: Registry[Verifier] = Registry(
    "verifier", builtins=lambda: importlib.import_module("agentrl.rewards.builtin")
)


class VerifierError(RuntimeError):
    """A verifier raised, timed out or returned something that is not a reward."""


def register_verifier(name: str, *, overwrite: bool = False) -> Callable[[Verifier], Verifier]:
    """Decorator: ``@register_verifier("exact_match")``."""
    return VERIFIERS.register(name, overwrite=overwrite)


def get_verifier(name: str) -> Verifier:
    """The verifier registered as ``name`` (or a ``module:attr`` path); unknown names fail with the list
    of known ones."""
    return VERIFIERS.get(name)


class VerifierConfigError(ConfigError):
    """No verifier scores the episodes, or the one named is not registered (found at start-up)."""


def resolve_verifier(
    configured: str | None, env_default: str | None, env_name: str = "the env", scores_itself: bool = False
) -> str | None:
    """Which verifier scores an env's episodes: the config's (``rollout.verifier``) wins, else the env's
    own ``verifier`` attribute; None for an env that ``scores_itself`` and names none. Otherwise no
    verifier, or an unknown name, is a :class:`VerifierConfigError`."""
    name = configured or env_default
    field = "rollout.verifier" if configured else f"{env_name}'s verifier attribute"
    if name is None:
        if scores_itself:
            return None
        raise VerifierConfigError(
            f"rollout.verifier: not set and {env_name} names no verifier, so nothing would score its "
            f"episodes; set rollout.verifier to one of: {', '.join(list_verifiers())}"
        )
    try:
        get_verifier(name)
    except KeyError as err:
        raise VerifierConfigError(f"{field}: {err.args[0]}") from None
    return name


def list_verifiers() -> list[str]:
    return VERIFIERS.names()


async def run_verifier(
    verifier: Verifier | str, trajectory: Trajectory, label: Any, timeout: float = 30.0
) -> bool:
    """Score ``trajectory`` in place. Returns True on success; on any failure sets status FAILED + error."""
    name = verifier if isinstance(verifier, str) else getattr(verifier, "__name__", "verifier")
    try:
        fn = get_verifier(verifier) if isinstance(verifier, str) else verifier
        out = fn(trajectory, label)
        if inspect.isawaitable(out):
            out = await asyncio.wait_for(out, timeout)
        if isinstance(out, RewardResult):
            reward, parts = float(out.reward), dict(out.parts)
        elif isinstance(out, int | float) and not isinstance(out, bool):
            reward, parts = float(out), {}
        else:
            raise VerifierError(f"returned {type(out).__name__}, expected float or RewardResult")
        if not math.isfinite(reward):
            raise VerifierError(f"returned a non-finite reward {reward}")
    except TimeoutError:
        trajectory.status = Status.FAILED
        trajectory.error = f"verifier {name} timed out after {timeout}s"
        return False
    except Exception as err:
        trajectory.status = Status.FAILED
        trajectory.error = f"verifier {name} failed: {type(err).__name__}: {err}"
        return False
    trajectory.reward = reward
    trajectory.reward_parts = parts
    return True
