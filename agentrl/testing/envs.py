"""Synthetic envs for tests and benchmarks of the rollout (stand-ins, not built-in envs).

:class:`SyntheticEnv` plays a multi-turn episode without looking at the model's text: a fixed (or
per-task) number of turns, an observation per turn, a tool latency drawn from a distribution, injected
exceptions, and a terminal reward drawn at random, so groups have reward variance. Real envs live in
``agentrl.envs``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Callable
from typing import Any

from agentrl.envs.base import Env, Message, StepResult

_instances = itertools.count()


class InjectedEnvError(RuntimeError):
    """An exception a synthetic env raises on purpose (fault injection)."""


def lognormal(median: float, sigma: float) -> Callable[[random.Random], float]:
    """A latency distribution: log-normal with the given median (seconds) and sigma."""
    return lambda rng: median * math.exp(rng.gauss(0.0, sigma))


class SyntheticEnv(Env):
    """See the module docstring. ``task`` keys used: ``prompt``, optional ``turns``."""

    scores_itself = True

    def __init__(
        self,
        turns: int = 2,
        tool_latency: float | Callable[[random.Random], float] = 0.0,
        fail_rate: float = 0.0,
        observation: str = "result: 42",
        observation_role: str = "tool",
        reward_p: float = 0.5,
        seed: int | None = None,
        stop: list[str] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.turns = turns
        self.tool_latency = tool_latency
        self.fail_rate = fail_rate
        self.observation = observation
        self.observation_role = observation_role
        self.reward_p = reward_p
        self.rng = random.Random(seed if seed is not None else next(_instances))
        self.stop = list(stop or [])
        self.tools = tools
        self.actions: list[str] = []
        self.closed = False
        self._target = turns

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self._target = int(task.get("turns", self.turns))
        self.actions = []
        prompt = task.get("prompt", "Solve the task.")
        return prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]

    async def step(self, action_text: str) -> StepResult:
        self.actions.append(action_text)
        lat = self.tool_latency(self.rng) if callable(self.tool_latency) else self.tool_latency
        if lat > 0:
            await asyncio.sleep(lat)
        if self.fail_rate and self.rng.random() < self.fail_rate:
            raise InjectedEnvError("synthetic env: injected tool failure")
        if len(self.actions) >= self._target:
            return StepResult(reward=float(self.rng.random() < self.reward_p), terminated=True)
        return StepResult(
            observation=f"{self.observation} (turn {len(self.actions)})",
            observation_role=self.observation_role,
        )

    async def close(self) -> None:
        self.closed = True
