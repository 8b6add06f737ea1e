"""The orchestrator as an async Ray actor (training on a cluster; tests run it in-process instead).

The actor builds its :class:`Orchestrator` inside its own process from a picklable ``builder``
(a zero-argument callable returning the orchestrator: engine client, tokenizer, env factory, dataset
and config are all created there, on the actor's event loop). Every method is ``async``, so Ray runs
them concurrently on that loop: a ``get_batch`` waiting for data never blocks ``pause_for_update``.

    actor = make_rollout_actor(OrchestratorSpec(cfg, urls, model_dir, MyEnv, tasks))
    await actor.start.remote()
    batch = await actor.get_batch.remote()                     # list[Trajectory] (pickled)
    await actor.pause_for_update.remote(); ...; await actor.resume_after_update.remote(v)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.envs.base import Env
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.dataset import DatasetCursor
from agentrl.rollout.orchestrator import Orchestrator
from agentrl.types import Trajectory


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
    """The actor's body (a plain class, so it can also be used and tested without Ray)."""

    def __init__(self, builder: Callable[[], Orchestrator]) -> None:
        self._builder = builder
        self._orch: Orchestrator | None = None

    @property
    def orch(self) -> Orchestrator:
        if self._orch is None:  # built lazily, on the actor's running event loop
            self._orch = self._builder()
        return self._orch

    async def start(self) -> None:
        await self.orch.start()

    async def stop(self) -> None:
        await self.orch.stop()
        await self.orch.engine.close()

    async def get_batch(
        self, num_groups: int | None = None, timeout: float | None = None
    ) -> list[Trajectory]:
        return await self.orch.buffer.get_batch(num_groups, timeout)

    async def pause_for_update(self) -> None:
        await self.orch.pause_for_update()

    async def resume_after_update(self, version: int) -> None:
        await self.orch.resume_after_update(version)

    async def evaluate(
        self, tasks: Sequence[dict[str, Any]], sampling: SamplingParams | None = None
    ) -> list[Trajectory]:
        return await self.orch.evaluate(tasks, sampling)

    async def stats(self, reset_window: bool = True) -> dict[str, float]:
        return self.orch.stats(reset_window)

    async def accounting(self) -> dict[str, int]:
        return self.orch.accounting()

    async def state_dict(self) -> dict[str, Any]:
        return self.orch.state_dict()

    async def load_state_dict(self, state: dict[str, Any], version: int | None = None) -> None:
        self.orch.load_state_dict(state, version)


def make_rollout_actor(builder: Callable[[], Orchestrator], **ray_options: Any) -> Any:
    """Create the Ray actor (``ray.init`` must have run). ``ray_options`` go to ``.options()``."""
    import ray

    cls = ray.remote(RolloutWorker)
    opts = {"num_cpus": 1, "max_concurrency": 1000, **ray_options}
    return cls.options(**opts).remote(builder)
