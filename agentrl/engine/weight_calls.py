"""The weight-update verbs of SGLang's native API, as the engine client sends them to every engine.

Each verb builds its request body and sends it to every control endpoint at once
(:meth:`~agentrl.engine.transport.EngineTransport.all`): full weights from a checkpoint directory, from
tensors in the sender's memory (CUDA IPC handles) or by broadcast in a process group, LoRA adapters
loaded and unloaded, and the version the engines report. :class:`~agentrl.engine.client.EngineClient`
offers them under the same names.

Distributed weight updates follow SGLang's protocol: the trainer is rank 0 of a new process group and
the engines' ranks start at ``rank_offset``. Both ``init_weights_update_group`` and
``update_weights_from_distributed`` only return once the trainer side has joined (the group's
rendezvous) or broadcast the tensors, so the trainer must await them *concurrently* with its own
``init_process_group`` / ``broadcast`` calls (e.g. ``asyncio.gather`` with work in a thread).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentrl.engine.transport import EngineTransport


class WeightUpdateCalls:
    """The weight-update verbs over one transport (see the module docstring)."""

    def __init__(self, transport: EngineTransport) -> None:
        self.transport = transport

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint reloads its weights from ``model_path`` (a HF checkpoint directory)."""
        payload: dict[str, Any] = {"model_path": str(model_path), "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self.transport.all("POST", "/update_weights_from_disk", payload)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int | list[int],
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Every endpoint joins the trainer's weight-broadcast group (trainer = rank 0).

        ``rank_offset`` is the first engine rank of the first endpoint; with several endpoints each
        following one starts after the previous one's ``tp_size`` ranks (read from
        ``/get_server_info``), or pass one offset per endpoint as a list.
        """
        endpoints = await self.transport.control_endpoints()
        if isinstance(rank_offset, int):
            offsets = [rank_offset]
            if len(endpoints) > 1:
                infos = await self.transport.all("GET", "/get_server_info")
                for info in infos[:-1]:
                    tp = int(info.get("tp_size", 1)) if isinstance(info, dict) else 1
                    offsets.append(offsets[-1] + tp)
        else:
            offsets = [int(o) for o in rank_offset]
            if len(offsets) != len(endpoints):
                raise ValueError(f"{len(offsets)} rank offsets for {len(endpoints)} endpoints")
        payloads: list[dict[str, Any] | None] = [
            {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": off,
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            }
            for off in offsets
        ]
        await self.transport.broadcast("POST", "/init_weights_update_group", payloads)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Every endpoint leaves the weight-broadcast group (SGLang's ``/destroy_weights_update_group``)."""
        await self.transport.all("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> None:
        """Announce one broadcast bucket; the trainer (rank 0) then broadcasts each tensor in order, or
        with ``load_format: flattened_bucket`` the bucket's bytes in one broadcast."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        if load_format is not None:
            payload["load_format"] = load_format
        await self.transport.all("POST", "/update_weights_from_distributed", payload)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint copies in the named tensors of a payload from
        :func:`agentrl.engine.named_tensors.pack_named_tensors` (one entry per tensor-parallel rank of
        the engine; the same payload for each). The engines must share the sender's machine (and GPU)."""
        payload: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self.transport.all("POST", "/update_weights_from_tensor", payload)

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint loads the PEFT adapter dir ``lora_path`` as ``lora_name`` (the embedded engine
        serves it to every request, as version ``weight_version``; SGLang to requests that name it)."""
        payload: dict[str, Any] = {
            "lora_name": lora_name,
            "lora_path": str(lora_path),
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self.transport.all("POST", "/load_lora_adapter", payload)

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        serialized_tensors: str,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint loads an adapter handed over in memory: a PEFT state dict packed by
        :func:`agentrl.engine.named_tensors.pack_named_tensors` and its ``adapter_config.json`` mapping."""
        payload: dict[str, Any] = {
            "lora_name": lora_name,
            "config_dict": config_dict,
            "serialized_tensors": serialized_tensors,
            "abort_all_requests": abort_all_requests,
        }
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self.transport.all("POST", "/load_lora_adapter_from_tensors", payload)

    async def unload_lora_adapter(self, lora_name: str, urls: list[str] | None = None) -> None:
        """Every endpoint (or those of ``urls``) unloads the adapter ``lora_name`` (SGLang's
        ``/unload_lora_adapter``: the name is refused to new requests at once, and the adapter freed once
        the running requests that use it end; the embedded engine takes its adapter off every request)."""
        endpoints = [ep for ep in await self.transport.control_endpoints() if urls is None or ep.url in urls]
        body = {"lora_name": lora_name}
        await asyncio.gather(
            *(self.transport.request("POST", "/unload_lora_adapter", body, endpoint=ep) for ep in endpoints)
        )

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> None:
        """Set the version string the engines report (SGLang's own default would abort everything)."""
        await self.transport.all(
            "POST",
            "/update_weight_version",
            {"new_version": str(new_version), "abort_all_requests": abort_all_requests},
        )


__all__ = ["WeightUpdateCalls"]
