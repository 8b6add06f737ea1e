"""``tensor``: the trainer's weights handed to engines on the same machine in memory, never through disk.

* Full weights (:class:`TensorSync`): :func:`push_tensors` lays them into one buffer on their device and
  SGLang's ``/update_weights_from_tensor`` maps it (CUDA IPC handles on a GPU, shared memory on the CPU; see
  :mod:`agentrl.engine.named_tensors`). A handle opens only on the GPU it was made on, so every trainer rank
  pushes to the engines on its own GPU (:func:`agentrl.weight_sync.update.route`).
* LoRA adapters (:class:`LoRATensorSync`): ``/load_lora_adapter_from_tensors`` with the PEFT config beside
  them, in shared memory (they are small).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrl.engine.named_tensors import pack_named_tensors
from agentrl.trainer.lora import adapter_config
from agentrl.weight_sync.update import LORA_NAME, RankSide, WeightUpdate, push_stats


@dataclass
class TensorPushStats:
    """One in-memory weight push: tensors, bytes, and seconds to pack and for the engines to copy
    (``seconds``: packing included); ``gather_seconds``: assembling the HF-named weights before it."""

    num_tensors: int = 0
    num_bytes: int = 0
    pack_seconds: float = 0.0
    seconds: float = 0.0
    gather_seconds: float = 0.0


async def push_tensors(client: Any, hf: dict[str, torch.Tensor], weight_version: int) -> TensorPushStats:
    """Every engine of ``client`` copies in ``hf`` (one buffer on the tensors' device) as
    ``weight_version``; the buffer is freed once they all answered."""
    t0 = time.perf_counter()
    packed = pack_named_tensors(list(hf.items()))
    t1 = time.perf_counter()
    try:
        await client.update_weights_from_tensor(
            [packed.payload], load_format=packed.load_format, weight_version=str(weight_version)
        )
    finally:
        packed.close()
        if any(t.is_cuda for t in hf.values()):
            torch.cuda.ipc_collect()  # blocks the engines mapped are freed now, not at the next collect
    return TensorPushStats(len(hf), packed.num_bytes, t1 - t0, time.perf_counter() - t0)


class TensorSync:
    """``tensor``: the weights, gathered on the trainer's device, go to engines on the same machine in
    memory (``/update_weights_from_tensor`` with CUDA IPC handles, or shared memory on the CPU; see
    :func:`push_tensors`). Every rank with engines (``client``) pushes to its own:
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
        return {**push_stats(t0, hf), "pack_seconds": pack_seconds}

    async def close(self, timeout: float = 30.0) -> bool:
        return True


async def connect_tensor(update: WeightUpdate, side: RankSide) -> TensorSync:
    if side.rank == 0 and side.client is None:
        raise ValueError("weight sync 'tensor' needs the engines' client on rank 0")
    return TensorSync(side.client, side.device)


async def connect_lora_tensor(update: WeightUpdate, side: RankSide) -> LoRATensorSync:
    return LoRATensorSync(side.client, side.model_path, side.lora)
