"""Agents as envs: any ``async def agent(task, client) -> float | None`` written on the openai SDK.

:class:`AgentEnv` carries the function through the env registry, so a run config names an agent the
way it names an env (``env: {name: my_pkg.agents:solve}``); :func:`~agentrl.envs.registry.make_env`
wraps any coroutine function in one. The rollout runs it with
:class:`~agentrl.rollout.agent.AgentRunner`, not with ``reset``/``step``: each episode gets an
``openai.AsyncOpenAI`` client whose base URL is a recording proxy, and the trajectories are built from
the tokens that proxy forwarded (:mod:`agentrl.rollout.agent_proxy`).

The agent returns the episode's reward, or None to let the verifier score it (``rollout.verifier``, or
``verifier=`` here). Extra keyword arguments (``env.kwargs``) are passed on to the agent.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from .base import Env, Message, StepResult

AgentFn = Callable[..., Awaitable[float | None]]


def is_agent(obj: Any) -> bool:
    """True for an ``async def`` function (an agent), as opposed to an env class or factory."""
    return inspect.iscoroutinefunction(obj)


class AgentEnv(Env):
    """An agent function in the env registry's clothing (see the module docstring)."""

    scores_itself = True  # the agent's return value is the reward; None falls back to the verifier

    def __init__(
        self, agent: AgentFn, timeout: float | None = None, verifier: str | None = None, **kwargs: Any
    ) -> None:
        if not is_agent(agent):
            raise TypeError(f"{agent!r} is not an async function (task, client) -> float | None")
        self.agent = agent
        self.timeout = timeout
        self.verifier = verifier
        self.kwargs = kwargs

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        raise TypeError("an AgentEnv is run by agentrl.rollout.agent.AgentRunner, not reset/step")

    async def step(self, action_text: str) -> StepResult:
        raise TypeError("an AgentEnv is run by agentrl.rollout.agent.AgentRunner, not reset/step")
