"""The trainer as Ray actors: :class:`TrainerGroup`, the typed async surface the driver awaits, over one
actor per rank, each a :class:`MegatronTrainer` in its own process.

``ray`` is imported lazily (GPU images may lack it). Usage (TP=1 on CPU; the update is an
:class:`agentrl.weight_sync.WeightUpdate`)::

    group = TrainerGroup(TrainerConfig(model_path=...), world_size=1)
    await group.connect_engines(WeightUpdate("disk", engine_urls, out_dir="run/weights"))
    metrics = await group.train_step(trajectories)  # every rank gets the same list; rank 0's metrics
    version = await group.sync_weights()
    await group.save_checkpoint(dir); await group.shutdown()

Every collective call fans out to all ranks (an :class:`~agentrl.actor_group.ActorGroup`) and returns rank
0's answer; a rank's error is raised named by its rank. A rank's actor (:class:`TrainerWorker`) only
forwards: the verbs and their meaning are the trainer's own.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
from typing import Any

from agentrl.actor_group import ActorGroup
from agentrl.cluster import location
from agentrl.trainer.config import TrainerConfig
from agentrl.types import Trajectory


class TrainerWorker:
    """The body of one rank's actor (plain class; :class:`TrainerGroup` wraps it with ``ray.remote``).

    Built in two steps, so that the ranks never meet at a port chosen before it is bound: rank 0
    :meth:`hosts <host_rendezvous>` the rendezvous store, then every rank :meth:`starts <start>` its
    trainer there."""

    def __init__(self, cfg: dict[str, Any], rank: int, world_size: int, deterministic: bool = False) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
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
        self._cfg, self._world_size, self._deterministic = cfg, world_size, deterministic
        self._store: Any = None
        self.trainer: Any = None
        # The trainer's async verbs (the engines' calls) run on one event loop, kept for the actor's life
        # (the engines' client lives on it from connect to disconnect: a new loop and connection per sync
        # cost time on every step). Plain methods that run the loop, not async methods: an async method
        # would turn the actor into an async actor whose methods run in Ray's own loop.
        self._loop = asyncio.new_event_loop()

    def host_rendezvous(self) -> int:
        """Rank 0: bind the store the ranks meet at, on a port the OS picks; that port."""
        from agentrl.engine.dist import host_store

        self._store = host_store(self._world_size)
        return int(self._store.port)

    def start(self, master_addr: str, master_port: int) -> None:
        """Build this rank's trainer, meeting the others at rank 0's store ``master_addr:master_port``."""
        import torch.distributed as dist

        from agentrl.trainer.trainer import MegatronTrainer

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        store = self._store or dist.TCPStore(master_addr, master_port, self._world_size, is_master=False)
        cfg = TrainerConfig.model_validate(self._cfg)
        self.trainer = MegatronTrainer(cfg, deterministic=self._deterministic, store=store)

    def call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``trainer.<verb>(*args, **kwargs)``, a coroutine run to completion on this actor's loop; for an
        attribute (``policy_version``, ``last_sync_stats``), its value."""
        if verb.startswith("_"):
            raise AttributeError(f"{verb!r} is not a trainer verb")
        attr = getattr(self.trainer, verb)
        if not callable(attr):
            return attr
        out = attr(*args, **kwargs)
        return self._loop.run_until_complete(out) if inspect.iscoroutine(out) else out

    def location(self) -> dict[str, Any]:
        """The rank's Ray node (id, IP) and pid (:func:`agentrl.cluster.location`)."""
        return location()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let go of the engines and their client (bounded by about ``2 * timeout``), stop the rank."""
        try:
            self.call("disconnect_engines", timeout)
        finally:
            self._loop.close()
            self.trainer.shutdown()


class TrainerGroup:
    """``world_size`` Ray actors (``num_gpus_per_rank`` each; 0 on CPU) forming one trainer; ``actors``,
    their :class:`~agentrl.actor_group.ActorGroup`.

    ``deterministic``: the run's deterministic switch, passed to every rank (see :class:`MegatronTrainer`).
    ``placement_group``: schedule rank i on that Ray placement group's bundle ``bundle_indices[i]``
    (default: bundle i), e.g. to put a trainer rank on the GPU of the engine it shares it with.
    ``resources``: custom Ray resources every rank asks for (which nodes may take the ranks).
    ``master_addr``: where the ranks meet rank 0's rendezvous (None: rank 0's node address, for ranks
    on several hosts).
    ``env``: environment variables every rank starts with (set before anything in it imports torch)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        world_size: int = 1,
        num_gpus_per_rank: float = 0.0,
        num_cpus_per_rank: float = 1.0,
        master_addr: str | None = "127.0.0.1",
        *,
        deterministic: bool = False,
        placement_group: Any = None,
        bundle_indices: list[int] | None = None,
        resources: dict[str, float] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        import ray

        self._ray = ray
        spec = cfg.model_dump(mode="json")
        self.actors = ActorGroup.spawn(
            TrainerWorker,
            [(spec, r, world_size, deterministic) for r in range(world_size)],
            placement_group=placement_group,
            bundle_indices=bundle_indices,
            env=env,
            num_gpus=num_gpus_per_rank,
            num_cpus=num_cpus_per_rank,
            resources=resources or {},
        )
        port = self.actors.wait_rank0("host_rendezvous")
        if master_addr is None:  # rank 0's node address: the ranks may sit on several hosts
            master_addr = self.actors.wait_rank0("location")["node_ip"]
        self.actors.wait_all("start", master_addr, port)  # construction errors surface here, rank named

    async def _all(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``verb`` on every rank (collectives need them all); rank 0's answer."""
        return (await self.actors.all("call", verb, *args, **kwargs))[0]

    async def _rank0(self, verb: str, *args: Any) -> Any:
        """``verb`` on rank 0 alone (what it holds by itself: counters, figures)."""
        return await self.actors.rank0("call", verb, *args)

    async def _shared(self, trajectories: list[Trajectory]) -> Any:
        """The batch in Ray's object store once, for every rank (pickled off the event loop)."""
        return await asyncio.to_thread(self._ray.put, trajectories)

    async def train_step(
        self, batch: list[Trajectory], max_staleness: int | None = None, record_logprobs: bool = False
    ) -> dict[str, float]:
        """One update on every rank; ``max_staleness`` (η) is asserted on the batch when given;
        ``record_logprobs``: keep the trainer's logprobs of the batch for :meth:`last_logprobs`."""
        return await self._all("train_step", await self._shared(batch), max_staleness, record_logprobs)

    async def compute_logprobs(self, trajectories: list[Trajectory]) -> list[list[float]]:
        """Per-response-token logprobs of the current weights, per trajectory."""
        return await self._all("compute_logprobs", await self._shared(trajectories))

    async def last_logprobs(self) -> dict[str, Any]:
        """The trainer's logprobs of the last recorded step (``MegatronTrainer.last_logprobs``)."""
        return await self._rank0("last_logprobs")

    async def policy_version(self) -> int:
        return await self._rank0("policy_version")

    async def locations(self) -> list[dict[str, Any]]:
        """Where each rank runs: its Ray node's id and IP, and its pid (rank order)."""
        return await self.actors.all("location")

    async def connect_engines(self, update: Any) -> None:
        """How :meth:`sync_weights` reaches the engines: ``update`` (an
        :class:`agentrl.weight_sync.WeightUpdate` with every engine's URL) goes to every rank, which connects
        to its own engines (``MegatronTrainer.connect_engines``). ``distributed`` opens the broadcast group
        now, its rendezvous at rank 0's node address unless the update names one."""
        await self._all("connect_engines", update)

    async def sync_weights(self, new_version: bool = True) -> int:
        """Push the weights to the connected engines; the policy version pushed (a new one, unless
        ``new_version`` is False: a resume's push of the checkpoint's weights)."""
        return await self._all("sync_weights", new_version)

    async def disconnect_engines(self, timeout: float = 30.0) -> bool:
        """Let go of the engines, bounded; True when it ended cleanly (:meth:`shutdown` does it too)."""
        return await self._all("disconnect_engines", timeout)

    async def last_sync_stats(self) -> dict[str, float]:
        """Rank 0's figures of its last weight push (``gather_seconds`` and the mode's: ``pack_seconds``
        and ``seconds`` in memory, buckets over a broadcast; empty before the first)."""
        return await self._rank0("last_sync_stats")

    async def offload(self) -> dict[str, float]:
        """Every rank moves its weights, gradients and optimizer state to host memory; rank 0's figures."""
        return await self._all("offload")

    async def onload(self) -> dict[str, float]:
        """Every rank brings its state back to the device; rank 0's figures."""
        return await self._all("onload")

    async def release_cached_memory(self) -> None:
        """Every rank hands the blocks its allocator caches (a step's activations) back to the driver."""
        await self._all("release_cached_memory")

    async def save_checkpoint(self, ckpt_dir: str) -> str:
        """Every rank writes its part; the step dir."""
        return str(await self._all("save_checkpoint", ckpt_dir))

    async def load_checkpoint(self, ckpt_dir: str) -> int:
        """Every rank restores its part (``ckpt_dir``: a step dir or the root); the restored step."""
        return await self._all("load_checkpoint", ckpt_dir)

    async def save_hf(self, out_dir: str) -> str | None:
        """The weights as an HF dir (rank 0 writes); the dir."""
        out = await self._all("save_hf", out_dir)
        return None if out is None else str(out)

    async def shutdown(self, timeout: float = 120.0, leave_timeout: float = 30.0) -> None:
        """Let go of the engines (every rank, each bounded by about ``2 * leave_timeout``), then stop every
        rank; all of it bounded by ``timeout``, and the actors are killed whatever happened."""
        try:
            await asyncio.wait_for(self.actors.all("shutdown", leave_timeout), timeout)
        finally:
            self.actors.kill()
