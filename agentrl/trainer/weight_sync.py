"""Pushing trainer weights to inference engines by distributed broadcast (SGLang's protocol, sender side).

Protocol (``/work``'s reference: SGLang's native API; the receiver is any SGLang server or the embedded
engine, both built on :mod:`agentrl.engine.dist`):

1. ``init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
   backend}`` on every engine, *concurrently* with the trainer joining the same group as rank 0
   (:func:`agentrl.engine.dist.init_custom_process_group`, a TCP rendezvous; the one helper both sides
   import). The group is separate from the trainer's own torch.distributed world.
2. Per bucket: ``update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version}``
   on every engine, concurrently with rank 0 broadcasting each tensor of the bucket, in ``names``
   order, one ``broadcast(src=0)`` per tensor (the receiver allocates ``empty(shape, dtype)`` and
   receives into it). ``weight_version`` goes with the last bucket only, so an engine never reports the
   new version while holding half-updated weights.

Tensors are HF-named full (unsharded) weights; gloo needs them on CPU, NCCL on the GPU. Every trainer
rank assembles them (:func:`gather_hf_state_dict`, collective over TP and PP); rank 0 alone talks to the
engines (:class:`EngineWeightSync`), by broadcast or by pointing them at an HF dir written to disk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.cluster import free_port
from agentrl.trainer.model import ModelArch, mcore_to_hf
from agentrl.trainer.moe import is_expert_param

log = logging.getLogger("agentrl.weight_sync")

Announce = Callable[[list[str], list[str], list[list[int]], bool], Awaitable[None]]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form SGLang's receiver passes to ``getattr(torch, ...)``)."""
    return str(dtype).removeprefix("torch.")


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


@dataclass
class BroadcastStats:
    num_tensors: int = 0
    num_buckets: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


def _broadcast_bucket(bucket: list[tuple[str, torch.Tensor]], group: Any) -> None:
    for _, t in bucket:
        dist.broadcast(t.contiguous(), src=0, group=group)


async def broadcast_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    group: Any,
    bucket_bytes: int = 512 << 20,
    announce: Announce | None = None,
) -> BroadcastStats:
    """Broadcast ``named_tensors`` from rank 0 of ``group``, bucket by bucket.

    ``announce(names, dtypes, shapes, is_last)`` (e.g. an ``EngineClient.update_weights_from_distributed``
    call) runs concurrently with each bucket's broadcasts, because the receiver only returns once it
    has received them. Without ``announce`` the receivers must know the names in advance.
    """
    t0 = time.perf_counter()
    stats = BroadcastStats()
    buckets = plan_buckets(named_tensors, bucket_bytes)
    for i, bucket in enumerate(buckets):
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        send = asyncio.to_thread(_broadcast_bucket, bucket, group)
        if announce is not None:
            await asyncio.gather(announce(names, dtypes, shapes, i == len(buckets) - 1), send)
        else:
            await send
        stats.num_tensors += len(bucket)
        stats.num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    stats.num_buckets = len(buckets)
    stats.seconds = time.perf_counter() - t0
    return stats


class WeightBroadcaster:
    """The trainer side of a distributed weight-sync group with a set of engines (an EngineClient)."""

    def __init__(
        self, client: Any, group_name: str = "agentrl_weight_sync", bucket_bytes: int = 512 << 20
    ) -> None:
        self.client = client
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self.group: Any = None

    async def connect(
        self,
        master_address: str,
        master_port: int,
        num_engine_ranks: int,
        backend: str,
        timeout: float = 600.0,
    ) -> None:
        """Create the group (trainer = rank 0, engines from rank 1) with every engine joining concurrently."""
        from agentrl.engine.dist import init_custom_process_group

        world = 1 + num_engine_ranks
        join = asyncio.to_thread(
            init_custom_process_group,
            backend=backend,
            init_method=f"tcp://{master_address}:{master_port}",
            world_size=world,
            rank=0,
            group_name=self.group_name,
            timeout=timeout,
        )
        ask = self.client.init_weights_update_group(
            master_address=master_address,
            master_port=master_port,
            rank_offset=1,
            world_size=world,
            group_name=self.group_name,
            backend=backend,
        )
        self.group, _ = await asyncio.gather(join, ask)

    async def push(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str
    ) -> BroadcastStats:
        if self.group is None:
            raise RuntimeError("WeightBroadcaster.connect() first")

        async def announce(names: list[str], dtypes: list[str], shapes: list[list[int]], last: bool) -> None:
            await self.client.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group_name=self.group_name,
                weight_version=weight_version if last else None,
            )

        return await broadcast_weights(named_tensors, self.group, self.bucket_bytes, announce=announce)

    async def close(self, timeout: float = 30.0) -> bool:
        """Leave the group with the engines; returns within about ``2 * timeout`` whatever they do.

        The engines are told to destroy their end (``/destroy_weights_update_group``) while this side
        destroys its own: an NCCL teardown waits for its peers, so one side alone would block forever.
        A side that does not finish in time is aborted (:func:`agentrl.engine.dist.leave_process_group`);
        an engine that does not answer is logged, not waited for. True when both sides left cleanly.
        """
        from agentrl.engine.dist import leave_process_group

        if self.group is None:
            return True
        group, self.group = self.group, None

        async def tell_engines() -> bool:
            if self.client is None:
                return True
            try:
                await asyncio.wait_for(self.client.destroy_weights_update_group(self.group_name), timeout)
                return True
            except Exception as err:  # an engine that is gone or hung must not stop the trainer leaving
                log.warning("engines did not leave the weight-sync group: %s", err)
                return False

        told, left = await asyncio.gather(tell_engines(), leave_process_group(group, timeout))
        return told and left


def gather_hf_state_dict(
    module: torch.nn.Module, arch: ModelArch, ps: Any, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The full HF-named state dict of a GPTModel sharded over TP and PP, assembled on every rank
    (collective over both; ``ps``: megatron's parallel_state), its tensors on ``device``."""
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    local = {
        k: v.detach()
        for k, v in module.state_dict().items()
        if not k.endswith("_extra_state") and v is not None
    }
    shards: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
    tp_group = ps.get_tensor_model_parallel_group()
    ep = ps.get_expert_model_parallel_world_size() if arch.moe is not None else 1
    for name in sorted(local):
        t = local[name].contiguous()
        if tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t, group=tp_group)
        else:
            parts = [t]
        if ep > 1 and is_expert_param(name):  # each expert-parallel rank holds other experts
            for r, part in enumerate(parts):
                held = [torch.empty_like(part) for _ in range(ep)]
                dist.all_gather(held, part.contiguous(), group=ps.get_expert_model_parallel_group())
                for e, x in enumerate(held):
                    shards.setdefault((pp_rank, r, e), {})[name] = x.to(device)
            continue
        for r, part in enumerate(parts):
            shards.setdefault((pp_rank, r) if ep == 1 else (pp_rank, r, 0), {})[name] = part.to(device)
    if pp > 1:
        gathered: list[Any] = [None] * pp
        dist.all_gather_object(
            gathered,
            {k: {n: v.cpu() for n, v in d.items()} for k, d in shards.items()},
            group=ps.get_pipeline_model_parallel_group(),
        )
        shards = {k: {n: v.to(device) for n, v in d.items()} for part in gathered for k, d in part.items()}
    return mcore_to_hf(shards, arch)


class EngineWeightSync:
    """One trainer rank's side of weight sync with the engines. Rank 0 does the talking: it holds the
    broadcast group (a :class:`WeightBroadcaster`) and tells the engines to load an HF dir from disk;
    on other ranks every call is a no-op. The caller owns the weight version."""

    def __init__(self, rank: int, device: torch.device, bucket_bytes: int = 512 << 20) -> None:
        self.rank = rank
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.broadcaster: WeightBroadcaster | None = None
        self.backend: str | None = None  # of the broadcast group, once opened (rank 0)

    @property
    def is_open(self) -> bool:
        return self.broadcaster is not None

    @property
    def gather_device(self) -> torch.device | str:
        """Where the weights to broadcast must be: the GPU for NCCL, else the CPU."""
        if self.device.type == "cpu" or (self.backend or "gloo") == "gloo":
            return "cpu"
        return self.device

    async def load_from_disk(
        self, client: Any, out_dir: str | Path, weight_version: int, abort_all_requests: bool = False
    ) -> None:
        """Make the engines load the HF dir ``out_dir`` as ``weight_version`` (rank 0; no client: no-op)."""
        if self.rank == 0 and client is not None:
            await client.update_weights_from_disk(
                str(out_dir), weight_version=str(weight_version), abort_all_requests=abort_all_requests
            )

    async def open(
        self,
        client: Any,
        num_engine_ranks: int = 1,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str | None = None,
        group_name: str = "agentrl_weight_sync",
        bucket_bytes: int | None = None,
    ) -> None:
        """Open the broadcast group with the engines (rank 0; backend default: NCCL on GPU, else gloo)."""
        if self.rank != 0:
            return
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.broadcaster = WeightBroadcaster(client, group_name, bucket_bytes or self.bucket_bytes)
        self.backend = backend
        await self.broadcaster.connect(master_address, master_port or free_port(), num_engine_ranks, backend)

    async def push(self, hf: dict[str, torch.Tensor], weight_version: int) -> BroadcastStats:
        """Broadcast ``hf`` to the engines in buckets as ``weight_version`` (rank 0, after :meth:`open`)."""
        if self.broadcaster is None:
            raise RuntimeError("init_weight_sync_group() first")
        return await self.broadcaster.push(list(hf.items()), str(weight_version))

    async def close(self, timeout: float = 30.0) -> bool:
        """Leave the broadcast group together with the engines, bounded (see :meth:`WeightBroadcaster.close`)."""
        if self.broadcaster is None:
            return True
        broadcaster, self.broadcaster = self.broadcaster, None
        return await broadcaster.close(timeout)
