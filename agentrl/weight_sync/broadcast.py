"""``distributed``: the trainer's weights broadcast over a process group it shares with the engines
(:class:`BroadcastSync`; with LoRA the adapters, :class:`LoRABroadcastSync`). SGLang's protocol, sender
side; the receiver is any SGLang server or the embedded engine, both built on :mod:`agentrl.engine.dist`:

1. ``init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
   backend}`` on every engine, *concurrently* with the trainer joining the same group as rank 0
   (:func:`agentrl.engine.dist.init_custom_process_group`, a TCP rendezvous; the one helper both sides
   import). The group is separate from the trainer's own torch.distributed world.
2. Per bucket: ``update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version}``
   on every engine, concurrently with rank 0 broadcasting each tensor of the bucket, in ``names``
   order, one ``broadcast(src=0)`` per tensor (the receiver allocates ``empty(shape, dtype)`` and
   receives into it). ``weight_version`` goes with the last bucket only, so an engine never reports the
   new version while holding half-updated weights. gloo sends from the CPU, NCCL from the GPU.
   ``flatten``: a bucket goes as one broadcast of its bytes (``load_format: flattened_bucket``, SGLang's
   ``FlattenedTensorBucket`` layout: :func:`agentrl.engine.dist.flatten_bucket`), one collective a bucket
   instead of one a tensor; a bucket whose tensors do not line up as bytes goes tensor by tensor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agentrl.engine.dist import FLATTENED, flatten_bucket, flattens, in_daemon_thread
from agentrl.weight_sync.update import RankSide, WeightUpdate

log = logging.getLogger("agentrl.weight_sync")

# announce(names, dtypes, shapes, is_last, load_format)
Announce = Callable[[list[str], list[str], list[list[int]], bool, str | None], Awaitable[None]]


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
    num_broadcasts: int = 0  # collectives: one a tensor, or one a flattened bucket
    seconds: float = 0.0


def _broadcast_bucket(bucket: list[tuple[str, torch.Tensor]], group: Any, flat: bool) -> None:
    if flat:
        dist.broadcast(flatten_bucket([t for _, t in bucket]), src=0, group=group)
        return
    for _, t in bucket:
        dist.broadcast(t.contiguous(), src=0, group=group)


async def broadcast_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    group: Any,
    bucket_bytes: int = 512 << 20,
    announce: Announce | None = None,
    flatten: bool = False,
) -> BroadcastStats:
    """Broadcast ``named_tensors`` from rank 0 of ``group``, bucket by bucket (``flatten``: each bucket
    as one broadcast of its bytes where its tensors line up, see the module docstring).

    ``announce(names, dtypes, shapes, is_last, load_format)`` (e.g. an
    ``EngineClient.update_weights_from_distributed`` call) runs concurrently with each bucket's
    broadcasts, because the receiver only returns once it has received them. Without ``announce`` the
    receivers must know the names (and the layout) in advance.
    """
    t0 = time.perf_counter()
    stats = BroadcastStats()
    buckets = plan_buckets(named_tensors, bucket_bytes)
    for i, bucket in enumerate(buckets):
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        flat = flatten and flattens([(t.dtype, list(t.shape)) for _, t in bucket])
        # a daemon thread: a broadcast whose receivers failed blocks for good, and must not hold up the
        # event loop's executor or the interpreter's exit
        send = in_daemon_thread(_broadcast_bucket, bucket, group, flat)
        if announce is not None:
            last, load_format = i == len(buckets) - 1, FLATTENED if flat else None
            await asyncio.gather(announce(names, dtypes, shapes, last, load_format), send)
        else:
            await send
        stats.num_tensors += len(bucket)
        stats.num_broadcasts += 1 if flat else len(bucket)
        stats.num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    stats.num_buckets = len(buckets)
    stats.seconds = time.perf_counter() - t0
    return stats


class WeightBroadcaster:
    """The trainer side of a distributed weight-sync group with a set of engines (an EngineClient)."""

    def __init__(
        self,
        client: Any,
        group_name: str = "agentrl_weight_sync",
        bucket_bytes: int = 512 << 20,
        flatten: bool = False,
    ) -> None:
        self.client = client
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self.flatten = flatten  # a bucket as one broadcast of its bytes (see the module docstring)
        self.group: Any = None

    async def connect(
        self,
        master_address: str,
        master_port: int | None,
        num_engine_ranks: int,
        backend: str,
        timeout: float = 600.0,
    ) -> None:
        """Create the group (trainer = rank 0, engines from rank 1) with every engine joining concurrently;
        its rendezvous at ``master_address:master_port`` (None: a port this side binds first)."""
        from agentrl.engine.dist import host_store, init_custom_process_group

        world = 1 + num_engine_ranks
        store = host_store(world, timeout) if master_port is None else None
        if store is not None:
            master_port = store.port
        join = asyncio.to_thread(
            init_custom_process_group,
            backend=backend,
            init_method=f"tcp://{master_address}:{master_port}",
            world_size=world,
            rank=0,
            group_name=self.group_name,
            timeout=timeout,
            store=store,
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

        async def announce(
            names: list[str], dtypes: list[str], shapes: list[list[int]], last: bool, load_format: str | None
        ) -> None:
            await self.client.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group_name=self.group_name,
                weight_version=weight_version if last else None,
                load_format=load_format,
            )

        return await broadcast_weights(
            named_tensors, self.group, self.bucket_bytes, announce=announce, flatten=self.flatten
        )

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


class BroadcastSync:
    """``distributed``: rank 0 broadcasts the weights in buckets over a process group it shares with the
    engines (:class:`WeightBroadcaster`; NCCL from the GPU, gloo from the CPU). Other ranks hold no group
    (``broadcaster`` None) and gather on the CPU."""

    def __init__(self, broadcaster: WeightBroadcaster | None, gather_device: torch.device | str) -> None:
        self.broadcaster = broadcaster
        self.gather_device = gather_device
        self.pushes = broadcaster is not None

    async def push(self, hf: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        if self.broadcaster is None:
            raise RuntimeError("only rank 0 of the trainer broadcasts weights")
        stats = await self.broadcaster.push(list(hf.items()), str(version))
        return {k: float(v) for k, v in dataclasses.asdict(stats).items()}

    async def close(self, timeout: float = 30.0) -> bool:
        """Leave the group together with the engines, bounded (see :meth:`WeightBroadcaster.close`)."""
        if self.broadcaster is None:
            return True
        broadcaster, self.broadcaster = self.broadcaster, None
        return await broadcaster.close(timeout)


class LoRABroadcastSync:
    """``distributed`` with LoRA: rank 0 broadcasts the adapters in one bucket (the engine applies a whole
    adapter at once), each ``B`` sent as ``s · B``: SGLang's broadcast protocol has no field for the scale,
    and the embedded engine scales ``B`` first in both of its modes (the merge,
    :func:`agentrl.models.lora.merged_weight`, and the unmerged record), so a pre-scaled ``B`` gives the
    same bits."""

    def __init__(self, broadcast: BroadcastSync, scale: float) -> None:
        self.broadcast = broadcast
        self.scale = scale
        # the adapters are gathered on the CPU, then sent from the backend's device
        self.gather_device = "cpu"
        self.pushes = broadcast.pushes

    async def push(self, hf: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        to = self.broadcast.gather_device
        scaled = {
            n: ((self.scale * t.float()).to(t.dtype) if n.endswith(".lora_B.weight") else t).to(to)
            for n, t in hf.items()
        }
        if self.broadcast.broadcaster is not None:  # one bucket
            self.broadcast.broadcaster.bucket_bytes = max(
                self.broadcast.broadcaster.bucket_bytes, _num_bytes(hf)
            )
        pack_seconds = time.perf_counter() - t0
        stats = await self.broadcast.push(scaled, version)
        return {**stats, "pack_seconds": pack_seconds, "seconds": time.perf_counter() - t0}

    async def close(self, timeout: float = 30.0) -> bool:
        return await self.broadcast.close(timeout)


def _num_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


async def connect_broadcast(update: WeightUpdate, side: RankSide) -> BroadcastSync:
    """Rank 0 opens the group now, joining it while every engine does; the other ranks hold none."""
    if side.rank != 0:
        return BroadcastSync(None, "cpu")
    if side.client is None:
        raise ValueError("weight sync 'distributed' needs the engines' client on rank 0")
    group = update.group
    backend = group.backend or ("nccl" if side.device.type == "cuda" else "gloo")
    broadcaster = WeightBroadcaster(
        side.client, bucket_bytes=group.bucket_bytes or 512 << 20, flatten=group.flatten
    )
    await broadcaster.connect(
        group.master_address or "127.0.0.1", group.master_port, group.num_engine_ranks or 1, backend
    )
    # the weights to broadcast must be where the backend sends from: the GPU for NCCL, else the CPU
    return BroadcastSync(
        broadcaster, "cpu" if side.device.type == "cpu" or backend == "gloo" else side.device
    )


async def connect_lora_broadcast(update: WeightUpdate, side: RankSide) -> LoRABroadcastSync:
    return LoRABroadcastSync(await connect_broadcast(update, side), side.lora.alpha / side.lora.rank)
