"""What a weight update is: one typed record (:class:`WeightUpdate`) of how the trainer's weights travel
(the transport), what travels (the payload), to which engines each trainer rank pushes (the targets) and
under which policy version, plus the routing of ranks to engines and the phases a push's seconds split
into.

The driver builds the record once per run with the engine URLs; each trainer rank resolves its own copy
when it connects (:func:`agentrl.weight_sync.registry.connect`): its targets (:func:`route`) and the payload
its engines take (:func:`payload_kind`). Every push then carries the version it hands over.

A transport and payload on one rank is an :class:`EngineSync` (where the weights must be gathered,
``push``, ``close``), built from the record and the rank's :class:`RankSide`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch

# disk: an HF (or PEFT) dir the engines load; tensor: in memory to engines on the trainer's machine (CUDA
# IPC handles, shared memory on the CPU); distributed: a broadcast over a process group shared with the
# engines (NCCL from the GPU, gloo from the CPU)
Transport = Literal["disk", "distributed", "tensor"]

# full: HF-named weights; lora: the PEFT-named adapters, which the engine applies to every request (merged
# into its weights or beside them, as the engine chooses); lora_named: the adapters, loaded under a name of
# their own per version and applied to the requests that name them (SGLang with --enable-lora)
PayloadKind = Literal["full", "lora", "lora_named"]

LORA_NAME = "agentrl"  # the lora_name a ``lora`` payload is loaded under

# transports whose engines take each rank's own weights (a handle opens only where it was made)
IN_MEMORY: frozenset[str] = frozenset({"tensor"})


@dataclass(frozen=True)
class BroadcastGroup:
    """Where a ``distributed`` update's process group meets, and how it sends: the trainer is rank 0, the
    engines' ranks follow. None: a default, resolved when the rank connects."""

    num_engine_ranks: int | None = None  # engine processes that join (None: one per engine URL, or 1)
    master_address: str | None = None  # the rendezvous host (None: trainer rank 0's node address)
    master_port: int | None = None  # its port (None: one rank 0 binds first)
    backend: str | None = None  # nccl or gloo (None: NCCL from a GPU, else gloo)
    bucket_bytes: int | None = None  # tensors per broadcast call (None: trainer.weight_sync_bucket_mb)
    flatten: bool = False  # a bucket as one broadcast of its bytes (trainer.weight_sync_flatten)


@dataclass(frozen=True)
class WeightUpdate:
    """One weight update, from the trainer to inference engines.

    The driver sets ``transport``, ``engine_urls``, the engines' ``api_key`` and the transport's own fields
    (``out_dir`` for disk, ``group`` for a broadcast); the rest is each rank's, resolved when it connects:
    ``targets`` (the engines it pushes to), ``payload`` (what they take) and, at each push, ``version``."""

    transport: Transport
    engine_urls: Sequence[str] = ()  # every engine the update reaches (kept as a tuple)
    out_dir: str | Path | None = None  # disk: where the HF (or PEFT) dir is written
    group: BroadcastGroup = field(default_factory=BroadcastGroup)  # distributed: the process group
    api_key: str | None = field(default=None, repr=False)  # the engines' key (Bearer), when they need one
    targets: tuple[str, ...] = ()  # the engines this rank pushes to (:func:`route`)
    payload: PayloadKind = "full"
    version: int | None = None  # the policy version a push hands over

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_urls", tuple(self.engine_urls))  # the record does not change

    async def connect(self, **rank: Any) -> Any:
        """This trainer rank's side of the update, ready to push: a
        :class:`~agentrl.weight_sync.registry.RankSync` (keywords: those of
        :func:`agentrl.weight_sync.registry.connect`). The trainer calls it without importing this package."""
        # imported here: the registry imports every transport, and they import this module
        from agentrl.weight_sync.registry import connect

        return await connect(self, **rank)


def route(transport: str, engine_urls: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The engines trainer rank ``rank`` pushes to. Rank 0 pushes to all of them from disk or over a
    broadcast; in memory (``tensor``) engine j takes its weights from rank ``j % world_size``, so colocated
    on GPUs, where engine i shares GPU i with rank i, every CUDA IPC handle opens on its own GPU."""
    if transport in IN_MEMORY:
        return list(engine_urls[rank::world_size])
    return list(engine_urls) if rank == 0 else []


def payload_kind(lora: Any, serves_adapters_by_name: bool) -> PayloadKind:
    """What travels: the full weights without ``trainer.lora``; else the adapters, under a name of their
    own per version to engines that apply an adapter only to the requests that name it."""
    if lora is None:
        return "full"
    return "lora_named" if serves_adapters_by_name else "lora"


def push_stats(started: float, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """A push's figures every transport reports: seconds since ``started``, tensors and bytes pushed."""
    return {
        "seconds": time.perf_counter() - started,
        "num_tensors": float(len(tensors)),
        "num_bytes": float(sum(t.numel() * t.element_size() for t in tensors.values())),
    }


def sync_phases(stats: dict[str, float]) -> dict[str, float]:
    """Where a push's seconds went, by phase, from a rank's figures (``MegatronTrainer.last_sync_stats``):
    ``gather`` (the trainer assembling the HF-named weights), ``pack`` (laying them out for the transport:
    one buffer, a dir on disk, a pickle, scaled adapters) and ``push`` (the engines taking them in). Empty
    before the first push."""
    if not stats:
        return {}
    pack = stats.get("pack_seconds", 0.0)
    return {"gather": stats["gather_seconds"], "pack": pack, "push": stats["seconds"] - pack}


@dataclass
class RankSide:
    """What one trainer rank brings to its side of an update: its rank and device, the HF dir its weights
    came from (config and tokenizer files go beside written weights), its LoRA config (None: full weights)
    and a client of the engines it pushes to (None: none)."""

    rank: int
    device: torch.device
    model_path: str | Path
    lora: Any = None
    client: Any = None


class EngineSync(Protocol):
    """One transport and payload on one rank: every rank gathers the HF-named weights onto
    ``gather_device``; the ranks whose side ``pushes`` hand them over."""

    gather_device: torch.device | str  # where the full HF-named weights must be gathered for the push
    pushes: bool  # whether this rank hands the weights over (rank 0; in memory, a rank with engines)

    async def push(self, hf: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Hand ``hf`` to the engines as weight version ``version`` (a rank that ``pushes``); returns its
        figures: ``seconds`` (the whole push), ``num_tensors``, ``num_bytes``, ``pack_seconds`` (the part
        laying the payload out, where there is one) and the transport's own."""
        ...

    async def close(self, timeout: float = 30.0) -> bool:
        """Let go of the engines, bounded; True when it ended cleanly."""
        ...
