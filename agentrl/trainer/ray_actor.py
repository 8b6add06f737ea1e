"""The trainer as Ray actors: one actor per rank, each a :class:`MegatronTrainer` in its own process.

``ray`` is imported lazily (GPU images may lack it). Usage (TP=1 on CPU, as ``train_async.py`` does)::

    group = TrainerGroup(TrainerConfig(model_path=...), world_size=1)
    metrics = group.train_step(trajectories)          # every rank gets the same list; rank 0's metrics
    group.sync_weights_from_disk(engine_urls, out_dir) # or init_weight_sync_group + sync_weights_distributed
    group.save_checkpoint(dir); group.shutdown()

Every call fans out to all ranks (they are collectives) and returns rank 0's answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from typing import Any

from agentrl.cluster import free_port
from agentrl.trainer.config import TrainerConfig
from agentrl.types import Trajectory


class TrainerWorker:
    """The body of one rank's actor (plain class; :class:`TrainerGroup` wraps it with ``ray.remote``)."""

    def __init__(
        self, cfg: dict[str, Any], rank: int, world_size: int, master_addr: str, master_port: int
    ) -> None:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port)
        )
        os.environ.setdefault("LOCAL_RANK", "0")  # Ray gives each actor its own visible GPU
        # Sequences of every length make the caching allocator split blocks it then cannot reuse: on an
        # H200 the trainer reserved 63 GB for a 23 GB peak, which leaves a colocated engine no room on an
        # 80 GB GPU. Growable segments keep the reservation near the peak. (Read at the process's first
        # CUDA allocation, which comes after this.)
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        # megatron-core imports wandb, when installed, for logging that agentrl does not use (the driver
        # logs, agentrl.metrics); importing it costs a second and makes scratch dirs in the temp dir that
        # an actor killed at shutdown leaves behind. An import of it here finds None and fails.
        sys.modules.setdefault("wandb", None)  # type: ignore[arg-type]
        from agentrl.trainer.trainer import MegatronTrainer

        self.trainer = MegatronTrainer(TrainerConfig.model_validate(cfg))
        # Every call that talks to the engines (the syncs of each step, the broadcast group) runs on one
        # event loop with one EngineClient per engine list, kept for the actor's life: a new loop and
        # connection per sync cost time on every step. Plain methods that run the loop, not async methods:
        # an async method would turn the actor into an async actor whose methods run in Ray's own loop.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: dict[tuple[str, ...], Any] = {}
        self._group_urls: list[str] | None = None  # the engines of the open broadcast group

    def train_step(
        self, trajectories: list[dict[str, Any]], max_staleness: int | None = None, record_logprobs: bool = False
    ) -> dict[str, float]:
        trajs = [Trajectory.from_dict(t) for t in trajectories]
        return self.trainer.train_step(trajs, max_staleness, record_logprobs)

    def last_logprobs(self) -> dict[str, Any]:
        return self.trainer.last_logprobs()

    def compute_logprobs(self, trajectories: list[dict[str, Any]]) -> list[list[float]]:
        return self.trainer.compute_logprobs([Trajectory.from_dict(t) for t in trajectories])

    def policy_version(self) -> int:
        return self.trainer.policy_version

    def save_hf(self, out_dir: str) -> str | None:
        out = self.trainer.save_hf(out_dir)
        return None if out is None else str(out)

    def _with_engines(self, engine_urls: list[str], call: Any) -> Any:
        """Run ``call(client)`` to completion on this actor's loop, ``client`` its EngineClient for
        ``engine_urls`` (None on other ranks than 0, and for no engines)."""
        from agentrl.engine.client import EngineClient

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        client = None
        if self.trainer.rank == 0 and engine_urls:
            client = self._clients.get(tuple(engine_urls))
            if client is None:
                client = self._clients[tuple(engine_urls)] = EngineClient(engine_urls)
        return self._loop.run_until_complete(call(client))

    def sync_weights_from_disk(
        self, engine_urls: list[str], out_dir: str, abort_all_requests: bool = False
    ) -> int:
        call = lambda c: self.trainer.sync_weights_from_disk(c, out_dir, abort_all_requests)  # noqa: E731
        return self._with_engines(engine_urls, call)

    def sync_weights_from_tensor(self, engine_urls: list[str]) -> int:
        return self._with_engines(engine_urls, self.trainer.sync_weights_from_tensor)

    def last_sync_stats(self) -> dict[str, float]:
        stats = self.trainer.last_sync_stats
        return {} if stats is None else {k: float(v) for k, v in dataclasses.asdict(stats).items()}

    def offload(self) -> dict[str, float]:
        return self.trainer.offload()

    def release_cached_memory(self) -> None:
        self.trainer.release_cached_memory()

    def onload(self) -> dict[str, float]:
        return self.trainer.onload()

    def init_weight_sync_group(
        self,
        engine_urls: list[str],
        num_engine_ranks: int,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str | None = None,
    ) -> None:
        self._group_urls = engine_urls  # the group keeps its client: later calls use the same one
        group = self.trainer.init_weight_sync_group
        self._with_engines(engine_urls, lambda c: group(c, num_engine_ranks, master_address, master_port, backend))

    def sync_weights_distributed(self) -> int:
        if self._group_urls is None:
            raise RuntimeError("sync_weights_distributed before init_weight_sync_group")
        return self._with_engines(self._group_urls, self.trainer.sync_weights_distributed)

    def save_checkpoint(self, ckpt_dir: str) -> str:
        return str(self.trainer.save_checkpoint(ckpt_dir))

    def load_checkpoint(self, path: str) -> int:
        self.trainer.load_checkpoint(path)
        return self.trainer.step

    def close_weight_sync_group(self, timeout: float = 30.0) -> bool:
        """Leave the broadcast group with the engines (they are told to leave concurrently), bounded."""
        if self._group_urls is None:
            return True
        return self._with_engines(self._group_urls, lambda _: self.trainer.close_weight_sync_group(timeout))

    def shutdown(self) -> None:
        self.close_weight_sync_group()
        if self._loop is not None:
            for client in self._clients.values():
                self._loop.run_until_complete(client.close())
            self._clients.clear()
            self._loop.close()
            self._loop = None
        self.trainer.shutdown()


class TrainerGroup:
    """``world_size`` Ray actors (``num_gpus_per_rank`` each; 0 on CPU) forming one trainer."""

    def __init__(
        self,
        cfg: TrainerConfig,
        world_size: int = 1,
        num_gpus_per_rank: float = 0.0,
        num_cpus_per_rank: float = 1.0,
        master_addr: str = "127.0.0.1",
    ) -> None:
        import ray

        self._ray = ray
        port = free_port()
        actor_cls = ray.remote(num_gpus=num_gpus_per_rank, num_cpus=num_cpus_per_rank)(TrainerWorker)
        self.actors = [
            actor_cls.remote(cfg.model_dump(mode="json"), r, world_size, master_addr, port)
            for r in range(world_size)
        ]
        ray.get([a.policy_version.remote() for a in self.actors])  # surface construction errors here

    def _all(self, method: str, *args: Any) -> Any:
        return self._ray.get([getattr(a, method).remote(*args) for a in self.actors])[0]

    def train_step(
        self, trajectories: list[Trajectory], max_staleness: int | None = None, record_logprobs: bool = False
    ) -> dict[str, float]:
        """One update on every rank; ``max_staleness`` (η) is asserted on the batch when given;
        ``record_logprobs``: keep the trainer's logprobs of the batch for :meth:`last_logprobs`."""
        return self._all("train_step", [t.to_dict() for t in trajectories], max_staleness, record_logprobs)

    def last_logprobs(self) -> dict[str, Any]:
        """The trainer's logprobs of the last recorded step (``MegatronTrainer.last_logprobs``)."""
        return self._ray.get(self.actors[0].last_logprobs.remote())

    def compute_logprobs(self, trajectories: list[Trajectory]) -> list[list[float]]:
        return self._all("compute_logprobs", [t.to_dict() for t in trajectories])

    def policy_version(self) -> int:
        return self._all("policy_version")

    def save_hf(self, out_dir: str) -> str | None:
        return self._all("save_hf", out_dir)

    def sync_weights_from_disk(
        self, engine_urls: list[str], out_dir: str, abort_all_requests: bool = False
    ) -> int:
        return self._all("sync_weights_from_disk", engine_urls, out_dir, abort_all_requests)

    def sync_weights_from_tensor(self, engine_urls: list[str]) -> int:
        """Hand the weights to engines on this machine in memory (``/update_weights_from_tensor``)."""
        return self._all("sync_weights_from_tensor", engine_urls)

    def last_sync_stats(self) -> dict[str, float]:
        """Rank 0's figures of its last weight push (tensors, bytes, seconds; empty before the first)."""
        return self._ray.get(self.actors[0].last_sync_stats.remote())

    def offload(self) -> dict[str, float]:
        """Every rank moves its weights, gradients and optimizer state to host memory; rank 0's figures."""
        return self._all("offload")

    def release_cached_memory(self) -> None:
        """Every rank hands the blocks its allocator caches (a step's activations) back to the driver."""
        self._all("release_cached_memory")

    def onload(self) -> dict[str, float]:
        """Every rank brings its state back to the device; rank 0's figures."""
        return self._all("onload")

    def init_weight_sync_group(
        self,
        engine_urls: list[str],
        num_engine_ranks: int,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str | None = None,
    ) -> None:
        self._all(
            "init_weight_sync_group", engine_urls, num_engine_ranks, master_address, master_port, backend
        )

    def sync_weights_distributed(self) -> int:
        return self._all("sync_weights_distributed")

    def save_checkpoint(self, ckpt_dir: str) -> str:
        return self._all("save_checkpoint", ckpt_dir)

    def load_checkpoint(self, path: str) -> int:
        return self._all("load_checkpoint", path)

    def shutdown(self, timeout: float = 120.0) -> None:
        """Close the weight-sync group with the engines, then stop every rank; bounded by ``timeout``
        (each rank's own teardown is bounded too); the actors are killed whatever happened."""
        try:
            self._ray.get([a.shutdown.remote() for a in self.actors], timeout=timeout)
        finally:
            for a in self.actors:
                self._ray.kill(a)
