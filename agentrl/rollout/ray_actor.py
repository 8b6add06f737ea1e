"""The orchestrator as an async Ray actor (training on a cluster; tests run it in-process instead).

The actor builds its :class:`Orchestrator` inside its own process from a picklable ``builder``
(a zero-argument callable returning the orchestrator: engine client, tokenizer, env factory, dataset
and config are all created there, on the actor's event loop). Its one generic verb, ``call``, reaches
the orchestrator's own methods; it is ``async``, so Ray runs the calls concurrently on that loop: a
``get_batch`` waiting for data never blocks ``pause_for_update``.

    actor = make_rollout_actor(OrchestratorSpec(cfg, urls, model_dir, MyEnv, tasks))
    await actor.call.remote("start")
    batch = await actor.call.remote("buffer.get_batch")                # list[Trajectory] (pickled)
    await actor.call.remote("pause_for_update"); ...; await actor.call.remote("resume_after_update", v)
    await actor.stop.remote()

Several orchestrators, each an actor, are one :class:`~agentrl.rollout.shards.RolloutGroup`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.actor_group import ActorGroup
from agentrl.engine.client import EngineClient
from agentrl.envs.base import Env
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.dataset import DatasetCursor
from agentrl.rollout.orchestrator import Orchestrator


@dataclass
class OrchestratorSpec:
    """A picklable description of an orchestrator (what a Ray actor receives as its ``builder``).

    ``env_factory`` must be picklable too: an env class, or ``functools.partial(EnvClass, **kwargs)``.
    """

    config: RolloutConfig
    engine_urls: str | list[str]
    model_dir: str  # the tokenizer is loaded from here with AutoTokenizer
    env_factory: Callable[[], Env]
    dataset: Sequence[dict[str, Any]] | DatasetCursor  # a cursor: drawn as it draws (agentrl.rollout.shards)
    engine_timeout: float = 600.0
    api_key: str | None = None
    router: bool = False  # engine_urls are sglang-routers (EngineClient's router mode)
    deterministic: bool = False  # the run's switch (agentrl.rollout.lockstep, seeded requests)

    def __call__(self) -> Orchestrator:
        from transformers import AutoTokenizer

        client = EngineClient(
            self.engine_urls, api_key=self.api_key, timeout=self.engine_timeout, router=self.router
        )
        tok = AutoTokenizer.from_pretrained(self.model_dir)
        return Orchestrator(
            self.config, client, tok, self.env_factory, self.dataset, deterministic=self.deterministic
        )


class RolloutWorker:
    """The actor's body (a plain class, so it can also be used and tested without Ray): the orchestrator,
    built lazily from ``builder`` on the actor's event loop, and reached by :meth:`call`."""

    def __init__(self, builder: Callable[[], Orchestrator]) -> None:
        self._builder = builder
        self._orch: Orchestrator | None = None

    @property
    def orch(self) -> Orchestrator:
        if self._orch is None:  # built lazily, on the actor's running event loop
            self._orch = self._builder()
        return self._orch

    async def call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``orchestrator.<verb>(*args, **kwargs)``, awaited when it is a coroutine; ``verb`` may be a dotted
        path (``buffer.get_batch``: the batches come from the orchestrator's buffer)."""
        if any(part.startswith("_") for part in verb.split(".")):
            raise AttributeError(f"{verb!r} is not an orchestrator verb")
        out = functools.reduce(getattr, verb.split("."), self.orch)(*args, **kwargs)
        return await out if inspect.isawaitable(out) else out

    async def location(self) -> dict[str, Any]:
        """The shard's Ray node (id, address) and pid (:func:`agentrl.cluster.location`)."""
        from agentrl.cluster import location

        return location()

    async def stop(self) -> None:
        """Stop the orchestrator, then close its engine client."""
        await self.orch.stop()
        await self.orch.engine.close()


ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 1, "max_concurrency": 1000}  # async: its calls run at once


def make_rollout_actor(builder: Callable[[], Orchestrator], **ray_options: Any) -> Any:
    """Create the Ray actor (``ray.init`` must have run). ``ray_options`` go to ``.options()``."""
    return ActorGroup.spawn(RolloutWorker, [(builder,)], **{**ACTOR_OPTIONS, **ray_options})[0]
