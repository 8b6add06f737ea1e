"""The trainer as Ray actors: :class:`TrainerGroup`, the typed async surface the driver awaits, over one
actor per rank, each a :class:`MegatronTrainer` in its own process.

``ray`` is imported lazily (GPU images may lack it). Usage (TP=1 on CPU)::

    group = TrainerGroup(TrainerConfig(model_path=...), world_size=1)
    await group.connect_engines("disk", engine_urls, out_dir="run/weights")  # or "tensor", "distributed"
    metrics = await group.train_step(trajectories)  # every rank gets the same list; rank 0's metrics
    version = await group.sync_weights()
    await group.save_checkpoint(dir); await group.shutdown()

Every collective call fans out to all ranks and returns rank 0's answer. A rank's actor
(:class:`TrainerWorker`) only forwards: the verbs and their meaning are the trainer's own.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
from typing import Any, Literal

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
        # The trainer's async verbs (the engines' calls) run on one event loop with one EngineClient per
        # engine list, kept for the actor's life: a new loop and connection per sync cost time on every
        # step. Plain methods that run the loop, not async methods: an async method would turn the actor
        # into an async actor whose methods run in Ray's own loop.
        self._loop = asyncio.new_event_loop()
        self._clients: dict[tuple[str, ...], Any] = {}

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

    def connect_engines(self, mode: str, engine_urls: list[str], **kwargs: Any) -> None:
        """``trainer.connect_engines`` with an EngineClient for the engines this rank pushes to (None when
        none): rank 0 pushes to all of them from disk or over a broadcast; in memory (``tensor``) engine j
        takes its weights from rank ``j % world_size``, so colocated on GPUs, where engine i shares GPU i
        with rank i, every CUDA IPC handle opens on its own GPU. A broadcast group's rendezvous without
        ``master_address`` is this rank's node address (what the engines, on other nodes too, reach it
        by)."""
        if kwargs.get("master_address") is None:
            kwargs["master_address"] = location()["node_ip"] or "127.0.0.1"
        rank, world = self.trainer.rank, self.trainer.world_size
        mine = engine_urls[rank::world] if mode == "tensor" else engine_urls if rank == 0 else []
        client = None
        if mine:
            from agentrl.engine.client import EngineClient

            client = self._clients.get(tuple(mine))
            if client is None:
                client = self._clients[tuple(mine)] = EngineClient(mine)
        self.call("connect_engines", mode, client, **kwargs)

    def location(self) -> dict[str, Any]:
        """The rank's Ray node (id, IP) and pid (:func:`agentrl.cluster.location`)."""
        return location()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let go of the engines (bounded by about ``2 * timeout``), close the clients, stop the rank."""
        try:
            self.call("disconnect_engines", timeout)
        finally:
            for client in self._clients.values():
                self._loop.run_until_complete(client.close())
            self._clients.clear()
            self._loop.close()
            self.trainer.shutdown()


class TrainerGroup:
    """``world_size`` Ray actors (``num_gpus_per_rank`` each; 0 on CPU) forming one trainer.

    ``deterministic``: the run's deterministic switch, passed to every rank (see :class:`MegatronTrainer`).
    ``placement_group``: schedule rank i on that Ray placement group's bundle ``bundle_indices[i]``
    (default: bundle i), e.g. to put a trainer rank on the GPU of the engine it shares it with.
    ``resources``: custom Ray resources every rank asks for (which nodes may take the ranks).
    ``env``: environment variables every rank starts with (set before anything in it imports torch)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        world_size: int = 1,
        num_gpus_per_rank: float = 0.0,
        num_cpus_per_rank: float = 1.0,
        master_addr: str = "127.0.0.1",
        *,
        deterministic: bool = False,
        placement_group: Any = None,
        bundle_indices: list[int] | None = None,
        resources: dict[str, float] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if bundle_indices is not None and placement_group is None:
            raise ValueError("bundle_indices needs a placement_group")
        bundles = list(range(world_size)) if bundle_indices is None else list(bundle_indices)
        if len(bundles) != world_size:
            raise ValueError(f"bundle_indices names {len(bundles)} bundles for {world_size} ranks")
        self._ray = ray
        actor_cls = ray.remote(
            num_gpus=num_gpus_per_rank, num_cpus=num_cpus_per_rank, resources=resources or {}
        )(TrainerWorker)
        spec = cfg.model_dump(mode="json")
        self.actors = []
        for r in range(world_size):
            where: dict[str, Any] = {"runtime_env": {"env_vars": dict(env)}} if env else {}
            if placement_group is not None:
                where["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundles[r]
                )
            self.actors.append(actor_cls.options(**where).remote(spec, r, world_size, deterministic))
        port = ray.get(self.actors[0].host_rendezvous.remote())
        ray.get([a.start.remote(master_addr, port) for a in self.actors])  # construction errors surface here

    async def _all(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``verb`` on every rank (collectives need them all); rank 0's answer."""
        return (await asyncio.gather(*[a.call.remote(verb, *args, **kwargs) for a in self.actors]))[0]

    async def _rank0(self, verb: str, *args: Any) -> Any:
        """``verb`` on rank 0 alone (what it holds by itself: counters, figures)."""
        return await self.actors[0].call.remote(verb, *args)

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
        return list(await asyncio.gather(*[a.location.remote() for a in self.actors]))

    async def connect_engines(
        self,
        mode: Literal["disk", "tensor", "distributed"],
        engine_urls: list[str],
        *,
        out_dir: str | None = None,
        num_engine_ranks: int | None = None,
        master_address: str | None = None,
        master_port: int | None = None,
        backend: str | None = None,
        bucket_bytes: int | None = None,
    ) -> None:
        """How :meth:`sync_weights` reaches the engines at ``engine_urls`` (``MegatronTrainer.connect_engines``;
        ``num_engine_ranks`` default: one per URL). ``distributed`` opens the broadcast group now, its
        rendezvous at ``master_address`` (default: rank 0's node address) and ``master_port`` (default: a
        port free there)."""
        kwargs = dict(
            out_dir=out_dir,
            num_engine_ranks=len(engine_urls) if num_engine_ranks is None else num_engine_ranks,
            master_address=master_address,
            master_port=master_port,
            backend=backend,
            bucket_bytes=bucket_bytes,
        )
        await asyncio.gather(*[a.connect_engines.remote(mode, engine_urls, **kwargs) for a in self.actors])

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

    async def shutdown(self, timeout: float = 120.0) -> None:
        """Let go of the engines (every rank, bounded), then stop every rank; all of it bounded by
        ``timeout``, and the actors are killed whatever happened."""
        try:
            await asyncio.wait_for(asyncio.gather(*[a.shutdown.remote() for a in self.actors]), timeout)
        finally:
            for a in self.actors:
                self._ray.kill(a)
