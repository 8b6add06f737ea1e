"""Which implementation moves an update: one entry per (transport, payload) in :data:`CONNECTORS`, and
:func:`connect`, which resolves one trainer rank's side of a :class:`WeightUpdate` (its engines, the
payload they take, the broadcast group's defaults) and builds it.

A new transport (a delta of the weights, a transfer between hosts) is a module of its own with an
:class:`~agentrl.weight_sync.update.EngineSync` per payload it carries, an entry here per payload, its
name in :data:`~agentrl.weight_sync.update.Transport`, and its placement rule, if it has one, in
:mod:`agentrl.weight_sync.rules`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from agentrl.engine.client import EngineClient
from agentrl.weight_sync.broadcast import connect_broadcast, connect_lora_broadcast
from agentrl.weight_sync.disk import connect_disk, connect_lora_disk
from agentrl.weight_sync.named_adapters import connect_named_adapters
from agentrl.weight_sync.tensor import connect_lora_tensor, connect_tensor
from agentrl.weight_sync.update import (
    EngineSync,
    PayloadKind,
    RankSide,
    Transport,
    WeightUpdate,
    payload_kind,
    route,
)

Connector = Callable[[WeightUpdate, RankSide], Awaitable[EngineSync]]

CONNECTORS: dict[tuple[Transport, PayloadKind], Connector] = {
    ("disk", "full"): connect_disk,
    ("tensor", "full"): connect_tensor,
    ("distributed", "full"): connect_broadcast,
    ("disk", "lora"): connect_lora_disk,
    ("tensor", "lora"): connect_lora_tensor,
    ("distributed", "lora"): connect_lora_broadcast,
    # SGLang has no broadcast path for adapters: every transport loads them by name, in the request or
    # from a dir (agentrl.weight_sync.named_adapters)
    ("disk", "lora_named"): connect_named_adapters,
    ("tensor", "lora_named"): connect_named_adapters,
    ("distributed", "lora_named"): connect_named_adapters,
}


class RankSync:
    """One trainer rank's side of an update, as the trainer holds it: the resolved record (``update``,
    its ``version`` the last one pushed), the transport's :class:`EngineSync` and the engines' client,
    closed with it when :func:`connect` opened it."""

    def __init__(self, update: WeightUpdate, sync: EngineSync, owned_client: Any = None) -> None:
        self.update = update
        self.sync = sync
        self._owned_client = owned_client

    @property
    def gather_device(self) -> torch.device | str:
        return self.sync.gather_device

    @property
    def pushes(self) -> bool:
        return self.sync.pushes

    async def push(self, hf: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Hand ``hf`` over as ``version``; the figures of every transport hold ``seconds`` and
        ``pack_seconds`` (see :func:`agentrl.weight_sync.update.sync_phases`)."""
        self.update = dataclasses.replace(self.update, version=version)
        stats = await self.sync.push(hf, version)
        return {"pack_seconds": 0.0, **stats}

    async def close(self, timeout: float = 30.0) -> bool:
        """Let go of the engines, bounded; True when it ended cleanly."""
        try:
            return await self.sync.close(timeout)
        finally:
            if self._owned_client is not None:
                client, self._owned_client = self._owned_client, None
                await client.close()


def _node_address() -> str:
    """The address engines reach this process by: its node's routable address when it runs in Ray (the
    engines may sit on other nodes: :func:`agentrl.cluster.node_address`), else loopback. A process in Ray
    has imported it; one outside need not import it."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        from agentrl.cluster import node_address

        return node_address()
    return "127.0.0.1"


async def connect(
    update: WeightUpdate,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    model_path: str | Path,
    lora: Any = None,
    client: Any = None,
    bucket_bytes: int = 512 << 20,
    flatten: bool = False,
) -> RankSync:
    """Trainer rank ``rank``'s side of ``update``, ready to push.

    Its engines: ``client`` when given (an EngineClient of the engines this rank pushes to), else a client
    of the URLs :func:`~agentrl.weight_sync.update.route` gives it from ``update.engine_urls`` (none: this
    rank pushes to none). The payload: the full weights, or with ``lora`` (a LoRAConfig) the adapters,
    PEFT-named, loaded by name where the engines serve adapters by name (SGLang with ``--enable-lora``,
    asked through the client). A broadcast's defaults: one engine rank per URL, the rendezvous at this
    rank's node address, ``bucket_bytes`` per bucket, each bucket's bytes in one broadcast with ``flatten``;
    ``distributed`` opens the group now (rank 0 joins it while every engine does)."""
    owned = None
    if client is None:
        targets = route(update.transport, update.engine_urls, rank, world_size)
        client = owned = EngineClient(targets, api_key=update.api_key) if targets else None
    targets = client.urls if client is not None else []
    try:
        named = lora is not None and client is not None and await client.serves_adapters_by_name()
        group = update.group
        if update.transport == "distributed":
            group = dataclasses.replace(
                group,
                num_engine_ranks=group.num_engine_ranks or len(update.engine_urls) or 1,
                master_address=group.master_address or _node_address(),
                bucket_bytes=group.bucket_bytes or bucket_bytes,
                flatten=group.flatten or flatten,
            )
        resolved = dataclasses.replace(
            update, targets=tuple(targets), payload=payload_kind(lora, named), group=group
        )
        connector = CONNECTORS.get((resolved.transport, resolved.payload))
        if connector is None:
            transports = ", ".join(sorted({t for t, _ in CONNECTORS}))
            raise ValueError(f"unknown weight sync mode {update.transport!r}: {transports}")
        sync = await connector(resolved, RankSide(rank, device, model_path, lora, client))
    except BaseException:
        if owned is not None:
            await owned.close()
        raise
    return RankSync(resolved, sync, owned)
