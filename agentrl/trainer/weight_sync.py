"""Getting trainer weights to inference engines: one class per ``weight_sync`` mode, behind one small
interface (:class:`EngineSync`: where the HF-named weights must be gathered, ``push``, ``close``).

* ``disk`` (:class:`DiskSync`): rank 0 writes an HF dir; the engines load it (``/update_weights_from_disk``).
* ``tensor`` (:class:`TensorSync`): in memory to engines on the trainer's machine
  (``/update_weights_from_tensor``, :func:`agentrl.trainer.colocate.push_tensors`).
* ``distributed`` (:class:`BroadcastSync`): a broadcast over a process group shared with the engines
  (:class:`WeightBroadcaster`, SGLang's protocol, sender side; below).

With LoRA (``trainer.lora``) only the adapters travel, PEFT-named (:mod:`agentrl.trainer.lora`). The
embedded engine applies the one adapter it holds to every request: ``disk`` writes a PEFT dir
(:class:`LoRADiskSync`, ``/load_lora_adapter``), ``tensor`` hands them over in memory
(:class:`LoRATensorSync`, ``/load_lora_adapter_from_tensors``), ``distributed`` broadcasts them in one
bucket with ``B`` scaled (:class:`LoRABroadcastSync`; the engine recognises PEFT names). SGLang applies an
adapter only to the requests that name it, and keeps the base weights resident: every mode then loads
each version under a name of its own (:class:`agentrl.trainer.adapter_sync.NamedAdapterSync`).

Tensors are HF-named full (unsharded) weights: every trainer rank assembles them
(:func:`gather_hf_state_dict`, collective over TP and PP) on the mode's ``gather_device``; the ranks
whose side ``pushes`` talk to the engines: rank 0, or in memory every rank to the engines on its GPU.
:func:`connect_engine_sync` builds a mode's side for one rank.

Broadcast protocol (SGLang's native API; the receiver is any SGLang server or the embedded engine, both
built on :mod:`agentrl.engine.dist`):

1. ``init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
   backend}`` on every engine, *concurrently* with the trainer joining the same group as rank 0
   (:func:`agentrl.engine.dist.init_custom_process_group`, a TCP rendezvous; the one helper both sides
   import). The group is separate from the trainer's own torch.distributed world.
2. Per bucket: ``update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version}``
   on every engine, concurrently with rank 0 broadcasting each tensor of the bucket, in ``names``
   order, one ``broadcast(src=0)`` per tensor (the receiver allocates ``empty(shape, dtype)`` and
   receives into it). ``weight_version`` goes with the last bucket only, so an engine never reports the
   new version while holding half-updated weights. gloo sends from the CPU, NCCL from the GPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from agentrl.trainer.adapter_sync import NamedAdapterSync, adapter_push_stats
from agentrl.trainer.colocate import push_tensors
from agentrl.trainer.model import ModelArch, mcore_to_hf, save_hf_dir
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


SyncMode = Literal["disk", "tensor", "distributed"]


class EngineSync(Protocol):
    """One way of getting a trainer's weights to the engines (a ``weight_sync`` mode), on one rank: every
    rank gathers the HF-named weights onto ``gather_device``; the ranks whose side ``pushes`` push them."""

    gather_device: torch.device | str  # where the full HF-named weights must be gathered for the push
    pushes: bool  # whether this rank hands the weights over (rank 0; in memory, a rank with engines)

    async def push(self, hf: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Hand ``hf`` to the engines as weight version ``version`` (a rank that ``pushes``); returns its
        figures."""
        ...

    async def close(self, timeout: float = 30.0) -> bool:
        """Let go of the engines, bounded; True when it ended cleanly."""
        ...


class DiskSync:
    """``disk``: rank 0 writes the weights as an HF dir to ``out_dir`` and the engines load it
    (``/update_weights_from_disk``); without a client the dir is only written. Only the ``writer`` rank
    pushes."""

    gather_device = "cpu"

    def __init__(self, client: Any, out_dir: str | Path, model_path: str | Path, writer: bool = True) -> None:
        self.client = client
        self.pushes = writer
        self.out_dir = out_dir
        self.model_path = model_path  # the HF dir whose config and tokenizer files go beside the weights

    async def push(self, hf: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        await asyncio.to_thread(save_hf_dir, hf, self.out_dir, self.model_path)
        if self.client is not None:
            await self.client.update_weights_from_disk(
                str(self.out_dir), weight_version=str(version), abort_all_requests=False
            )
        return {"seconds": time.perf_counter() - t0}

    async def close(self, timeout: float = 30.0) -> bool:
        return True


class TensorSync:
    """``tensor``: the weights, gathered on the trainer's device, go to engines on the same machine in
    memory (``/update_weights_from_tensor`` with CUDA IPC handles, or shared memory on the CPU; see
    :func:`agentrl.trainer.colocate.push_tensors`). Every rank with engines (``client``) pushes to its own:
    a CUDA IPC handle opens only on the GPU it was made on."""

    def __init__(self, client: Any, device: torch.device) -> None:
        self.client = client
        self.gather_device = device
        self.pushes = client is not None

    async def push(self, hf: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        stats = await push_tensors(self.client, hf, version)
        return {k: float(v) for k, v in dataclasses.asdict(stats).items()}

    async def close(self, timeout: float = 30.0) -> bool:
        return True


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


LORA_NAME = "agentrl"  # the lora_name the trainer's adapter is loaded under


def _num_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class LoRADiskSync:
    """``disk`` with LoRA: rank 0 writes the adapters as a PEFT dir to ``out_dir`` and the engines load it
    (``/load_lora_adapter``; the embedded engine serves it as ``engine.lora_apply`` says, SGLang by name)."""

    gather_device = "cpu"

    def __init__(
        self, client: Any, out_dir: str | Path, model_path: str | Path, lora: Any, writer: bool
    ) -> None:
        self.client = client
        self.pushes = writer
        self.out_dir = out_dir
        self.model_path = model_path
        self.lora = lora

    async def push(self, hf: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        from agentrl.trainer.lora import save_peft_dir

        t0 = time.perf_counter()
        await asyncio.to_thread(save_peft_dir, hf, self.lora, self.out_dir, str(self.model_path))
        if self.client is not None:
            await self.client.load_lora_adapter(LORA_NAME, str(self.out_dir), weight_version=str(version))
        return adapter_push_stats(t0, hf)

    async def close(self, timeout: float = 30.0) -> bool:
        return True


class LoRATensorSync:
    """``tensor`` with LoRA: the adapters go to the engines on this rank's machine in memory (shared memory:
    they are small), ``/load_lora_adapter_from_tensors`` with the PEFT config beside them."""

    gather_device = "cpu"

    def __init__(self, client: Any, model_path: str | Path, lora: Any) -> None:
        self.client = client
        self.pushes = client is not None
        self.model_path = model_path
        self.lora = lora

    async def push(self, hf: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        from agentrl.engine.named_tensors import pack_named_tensors
        from agentrl.trainer.lora import adapter_config

        t0 = time.perf_counter()
        packed = pack_named_tensors(list(hf.items()))
        pack_seconds = time.perf_counter() - t0
        try:
            await self.client.load_lora_adapter_from_tensors(
                LORA_NAME,
                adapter_config(self.lora, str(self.model_path)),
                packed.payload,
                load_format=packed.load_format,
                weight_version=str(version),
            )
        finally:
            packed.close()
        # the same figures as a full tensor push, which a colocated step splits into pack and push
        return {**adapter_push_stats(t0, hf), "pack_seconds": pack_seconds}

    async def close(self, timeout: float = 30.0) -> bool:
        return True


class LoRABroadcastSync:
    """``distributed`` with LoRA: rank 0 broadcasts the adapters in one bucket (the engine applies a whole
    adapter at once), each ``B`` sent as ``s · B``: SGLang's broadcast protocol has no field for the scale,
    and the embedded engine scales ``B`` first in both of its modes (the merge,
    :func:`agentrl.models.lora.merged_weight`, and the unmerged record), so a pre-scaled ``B`` gives the
    same bits."""

    def __init__(self, broadcast: BroadcastSync, scale: float) -> None:
        self.broadcast = broadcast
        self.scale = scale
        self.gather_device = (
            "cpu"  # the adapters are gathered on the CPU, then sent from the backend's device
        )
        self.pushes = broadcast.pushes

    async def push(self, hf: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        to = self.broadcast.gather_device
        scaled = {
            n: ((self.scale * t.float()).to(t.dtype) if n.endswith(".lora_B.weight") else t).to(to)
            for n, t in hf.items()
        }
        if self.broadcast.broadcaster is not None:  # one bucket
            self.broadcast.broadcaster.bucket_bytes = max(
                self.broadcast.broadcaster.bucket_bytes, _num_bytes(hf)
            )
        return await self.broadcast.push(scaled, version)

    async def close(self, timeout: float = 30.0) -> bool:
        return await self.broadcast.close(timeout)


async def connect_engine_sync(
    mode: SyncMode,
    client: Any,
    rank: int,
    device: torch.device,
    model_path: str | Path,
    *,
    out_dir: str | Path | None = None,
    num_engine_ranks: int = 1,
    master_address: str = "127.0.0.1",
    master_port: int | None = None,
    backend: str | None = None,
    bucket_bytes: int = 512 << 20,
    lora: Any = None,
) -> EngineSync:
    """Trainer rank ``rank``'s side of ``mode`` with the engines behind ``client`` (an EngineClient of the
    engines this rank pushes to: all on rank 0, or in memory those on its GPU; None for none).
    ``distributed`` opens the broadcast group now: rank 0 joins it while every engine does (backend
    default: NCCL on a GPU, else gloo).
    ``lora`` (a LoRAConfig): push only the adapters (PEFT-named); to engines that serve adapters by name
    (SGLang with ``--enable-lora``, asked through ``client``) as
    :class:`~agentrl.trainer.adapter_sync.NamedAdapterSync`, in every mode."""
    if lora is not None and client is not None and await client.serves_adapters_by_name():
        if mode == "disk" and out_dir is None:
            raise ValueError("weight sync from disk needs out_dir (where the PEFT dirs are written)")
        return NamedAdapterSync(client, model_path, lora, out_dir if mode == "disk" else None)
    if lora is not None and mode == "disk" and out_dir is not None:
        return LoRADiskSync(client if rank == 0 else None, out_dir, model_path, lora, writer=rank == 0)
    if lora is not None and mode == "tensor":
        return LoRATensorSync(client, model_path, lora)
    if mode == "disk":
        if out_dir is None:
            raise ValueError("weight sync from disk needs out_dir (where the HF dir is written)")
        return DiskSync(client if rank == 0 else None, out_dir, model_path, writer=rank == 0)
    if mode not in ("tensor", "distributed"):
        raise ValueError(f"unknown weight sync mode {mode!r}: disk, tensor or distributed")
    if rank == 0 and client is None:
        raise ValueError(f"weight sync {mode!r} needs the engines' client on rank 0")
    if mode == "tensor":
        return TensorSync(client, device)
    if lora is not None:
        sync = await connect_engine_sync(
            mode,
            client,
            rank,
            device,
            model_path,
            num_engine_ranks=num_engine_ranks,
            master_address=master_address,
            master_port=master_port,
            backend=backend,
            bucket_bytes=bucket_bytes,
        )
        return LoRABroadcastSync(sync, lora.alpha / lora.rank)  # type: ignore[arg-type]
    if rank != 0:
        return BroadcastSync(None, "cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    broadcaster = WeightBroadcaster(client, bucket_bytes=bucket_bytes)
    await broadcaster.connect(master_address, master_port, num_engine_ranks, backend)
    # the weights to broadcast must be where the backend sends from: the GPU for NCCL, else the CPU
    return BroadcastSync(broadcaster, "cpu" if device.type == "cpu" or backend == "gloo" else device)
