"""``disk``: trainer rank 0 writes the weights as an HF dir (:class:`DiskSync`; with LoRA the adapters as a
PEFT dir, :class:`LoRADiskSync`) and the engines load it (``/update_weights_from_disk``,
``/load_lora_adapter``): any engine that sees the file system. Without engines the dir is only written.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from agentrl.trainer.lora import save_peft_dir
from agentrl.trainer.model import save_hf_dir
from agentrl.weight_sync.update import LORA_NAME, RankSide, WeightUpdate, push_stats


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
        pack_seconds = time.perf_counter() - t0
        if self.client is not None:
            await self.client.update_weights_from_disk(
                str(self.out_dir), weight_version=str(version), abort_all_requests=False
            )
        return {**push_stats(t0, hf), "pack_seconds": pack_seconds}

    async def close(self, timeout: float = 30.0) -> bool:
        return True


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
        t0 = time.perf_counter()
        await asyncio.to_thread(save_peft_dir, hf, self.lora, self.out_dir, str(self.model_path))
        pack_seconds = time.perf_counter() - t0
        if self.client is not None:
            await self.client.load_lora_adapter(LORA_NAME, str(self.out_dir), weight_version=str(version))
        return {**push_stats(t0, hf), "pack_seconds": pack_seconds}

    async def close(self, timeout: float = 30.0) -> bool:
        return True


async def connect_disk(update: WeightUpdate, side: RankSide) -> DiskSync:
    if update.out_dir is None:
        raise ValueError("weight sync from disk needs out_dir (where the HF dir is written)")
    writer = side.rank == 0
    return DiskSync(side.client if writer else None, update.out_dir, side.model_path, writer=writer)


async def connect_lora_disk(update: WeightUpdate, side: RankSide) -> LoRADiskSync:
    if update.out_dir is None:
        raise ValueError("weight sync from disk needs out_dir (where the PEFT dir is written)")
    writer = side.rank == 0
    return LoRADiskSync(side.client if writer else None, update.out_dir, side.model_path, side.lora, writer)
