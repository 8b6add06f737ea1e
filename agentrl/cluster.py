"""Cluster glue: Ray actors that own the run's server processes (inference engines, tool servers).

A :class:`ServiceActor` starts one server process inside its actor (so Ray places it: an engine actor
asks for the GPUs its engine uses) and hands back the server's URL; ``stop()`` stops the process group.
The driver keeps every actor it started and stops them all in a ``finally`` (:func:`stop_all`), so a
Ctrl-C or an error leaves no server behind; the embedded engine and the retrieval server also exit on
their own when their parent dies.

What a service runs is a picklable zero-argument ``start`` callable returning a handle with ``.url`` and
``.stop()`` (``start_local_server``, ``SGLangLauncher``, ``start_retrieval_server``...).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, Protocol


class ServiceHandle(Protocol):
    url: str

    def stop(self) -> None: ...


class ServiceWorker:
    """The actor body (usable without Ray too): one server process, its URL, and a stop."""

    def __init__(self, name: str, start: Callable[[], ServiceHandle]) -> None:
        self.name = name
        self._handle: ServiceHandle | None = start()

    def url(self) -> str:
        if self._handle is None:
            raise RuntimeError(f"service {self.name} is stopped")
        return self._handle.url

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            handle.stop()


def start_service(
    name: str, start: Callable[[], ServiceHandle], num_cpus: float = 0, num_gpus: float = 0
) -> Any:
    """A Ray actor running ``start()``; blocks until the server is up and returns the actor handle."""
    import ray

    actor = (
        ray.remote(ServiceWorker).options(name=None, num_cpus=num_cpus, num_gpus=num_gpus).remote(name, start)
    )
    ray.get(actor.url.remote())  # surfaces a start failure here, with the server's log tail
    return actor


def stop_all(actors: list[Any], timeout: float = 60.0) -> None:
    """Stop every service actor (best effort, each independently), then kill the actors."""
    import ray

    for actor in reversed(actors):
        with contextlib.suppress(Exception):
            ray.get(actor.stop.remote(), timeout=timeout)
        with contextlib.suppress(Exception):
            ray.kill(actor)
    actors.clear()


class TrainerWorker:
    """One trainer rank as a Ray actor: sets the torch.distributed env of its rank, then builds
    :class:`~agentrl.trainer.trainer.MegatronTrainer`. Blocking work runs off the actor's event loop."""

    def __init__(
        self,
        cfg: dict[str, Any],
        rank: int,
        world_size: int,
        master_port: int,
        engine_urls: list[str],
        api_key: str | None = None,
    ) -> None:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port),
        )
        from agentrl.engine.client import EngineClient
        from agentrl.trainer.trainer import MegatronTrainer, TrainerConfig

        self.trainer = MegatronTrainer(TrainerConfig.model_validate(cfg))
        # only rank 0 talks to the engines
        self.client = EngineClient(engine_urls, api_key=api_key) if rank == 0 and engine_urls else None

    async def train_step(self, trajectories: list[Any]) -> dict[str, float]:
        import asyncio

        return await asyncio.to_thread(self.trainer.train_step, trajectories)

    async def policy_version(self) -> int:
        return self.trainer.policy_version

    async def set_policy_version(self, version: int) -> None:
        self.trainer.policy_version = version

    async def sync_weights_from_disk(self, out_dir: str) -> int:
        return await self.trainer.sync_weights_from_disk(self.client, out_dir)

    async def init_weight_sync_group(self, num_engine_ranks: int) -> None:
        await self.trainer.init_weight_sync_group(self.client, num_engine_ranks=num_engine_ranks)

    async def sync_weights_distributed(self) -> int:
        return await self.trainer.sync_weights_distributed(self.client)

    async def save_checkpoint(self, ckpt_dir: str) -> str:
        import asyncio

        return str(await asyncio.to_thread(self.trainer.save_checkpoint, ckpt_dir))

    async def load_checkpoint(self, path: str) -> int:
        import asyncio

        await asyncio.to_thread(self.trainer.load_checkpoint, path)
        return self.trainer.step

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.close()
        self.trainer.shutdown()


class TrainerGroup:
    """All trainer ranks (one Ray actor each); every call goes to every rank (the trainer is SPMD) and
    rank 0's answer is returned."""

    def __init__(
        self,
        cfg: dict[str, Any],
        world_size: int,
        engine_urls: list[str],
        api_key: str | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
    ) -> None:
        import ray

        from agentrl.trainer.trainer import free_port

        port = free_port()
        cls = ray.remote(TrainerWorker).options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=4)
        self.actors = [cls.remote(cfg, r, world_size, port, engine_urls, api_key) for r in range(world_size)]
        ray.get([a.policy_version.remote() for a in self.actors])  # construction errors surface here

    async def call(self, method: str, *args: Any) -> Any:
        import asyncio

        results = await asyncio.gather(*(getattr(a, method).remote(*args) for a in self.actors))
        return results[0]

    def kill(self) -> None:
        import ray

        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.get(a.shutdown.remote(), timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors = []
