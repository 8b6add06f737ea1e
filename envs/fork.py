"""Forking an env mid-episode: what a tree rollout (:mod:`agentrl.rollout.tree`) does at a branch point.

Two ways, in this order:

* **fork**: the env implements :meth:`~agentrl.envs.base.Env.fork` (sync or async) and returns a copy of
  itself in its current state;
* **replay**: the env says it is ``deterministic`` (the same task and the same action texts always give
  the same observations): a fresh env from the run's factory is reset with the same task, and the
  episode's action texts are stepped again. Each replayed step must give the recorded result (its
  observation, messages, reward and end flags); a difference is a :class:`ForkError` naming the step,
  because the children would otherwise continue from a state their parent never saw.

An env that is neither cannot branch: :func:`check_forkable` refuses it when a run with ``rollout.tree``
loads, naming the env.

What the built-ins keep (each a plain ``fork``, no replay):

* ``search`` (:class:`~agentrl.envs.search.SearchEnv`): its turn and search counters; the retrieval
  client (an HTTP pool, no episode state) is shared.
* ``tool`` / ``python`` (:class:`~agentrl.envs.tool_env.ToolEnv`): its turn counter; the tools are shared.
  The sandboxes keep no state between runs, so there is no sandbox state to copy: every run of the
  process sandbox gets a fresh working directory and, as root, a uid leased for that run alone; every
  run of the Docker sandbox is an exec in a pooled container of its own (read-only root, tmpfs work dir,
  the image's one non-root user), scrubbed before the next run. A fork's runs therefore share no
  writable directory with its parent's, and no uid on the process sandbox (on Docker the container is
  the boundary, as between any two runs): every isolation guarantee of the sandbox suite holds. A file a
  run writes is gone at the next call, so a snapshot (``docker commit``) would hold nothing. A user tool
  that keeps per-episode state of its own is shared by the fork, and must not be used with tree
  rollouts.
* ``math``: nothing to keep (one turn).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .base import Env, Message, StepResult


class ForkError(RuntimeError):
    """An env could not be forked (a replay that did not reproduce the episode, or no way to fork)."""


ForkMethod = Literal["fork", "replay"]


def fork_method(env_cls: type) -> ForkMethod | None:
    """How an env class forks: its own ``fork``, replay (``deterministic = True``), or None (it cannot)."""
    if getattr(env_cls, "fork", Env.fork) is not Env.fork:
        return "fork"
    if getattr(env_cls, "deterministic", False):
        return "replay"
    return None


def check_forkable(env_cls: type, name: str) -> ForkMethod:
    """The env's fork method; a ValueError naming the env when it has none (tree rollouts need one)."""
    method = fork_method(env_cls)
    if method is None:
        raise ValueError(_refusal(env_cls, name))
    return method


def _refusal(env_cls: type, name: str) -> str:
    return (
        f"env {name!r} ({getattr(env_cls, '__qualname__', env_cls)}) cannot branch, and rollout.tree "
        "needs it to: give it a fork() that copies its state, or set deterministic = True when the same "
        "task and action texts always give the same observations (it is then forked by replay)"
    )


def _outcome(res: StepResult) -> tuple[Any, ...]:
    """What a replayed step must reproduce (tool latencies and info may differ)."""
    return (
        res.observation,
        res.messages,
        res.reward,
        res.terminated,
        res.truncated,
        res.observation_format,
        res.observation_role,
    )


@dataclass
class EpisodeLog:
    """What replaying an episode needs: its task, the initial messages, each action and its result."""

    task: dict[str, Any]
    messages: list[Message]
    steps: list[tuple[str, StepResult]] = field(default_factory=list)

    def copy(self) -> EpisodeLog:
        return EpisodeLog(self.task, self.messages, list(self.steps))


async def fork_env(env: Env, log: EpisodeLog, factory: Callable[[], Env]) -> Env:
    """A new env in ``env``'s current state: ``env.fork()``, else a replay of ``log`` into ``factory()``.

    Raises :class:`ForkError` when the env cannot fork or the replay diverges (the replayed env is
    closed then)."""
    method = fork_method(type(env))
    if method == "fork":
        child = env.fork()
        return await child if inspect.isawaitable(child) else child
    if method is None:
        raise ForkError(_refusal(type(env), type(env).__name__))
    child = factory()
    try:
        messages = await child.reset(dict(log.task))
        if messages != log.messages:
            raise ForkError(f"{type(env).__name__} replay: reset gave other messages than the episode's")
        for n, (action, recorded) in enumerate(log.steps, 1):
            res = await child.step(action)
            if _outcome(res) != _outcome(recorded):
                raise ForkError(
                    f"{type(env).__name__} replay: step {n} gave another result than the episode's "
                    f"(is the env really deterministic?): {_outcome(res)!r} != {_outcome(recorded)!r}"
                )
    except BaseException:
        await child.close()
        raise
    return child
