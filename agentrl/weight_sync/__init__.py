"""Weight sync: getting the trainer's weights to the inference engines, end to end.

An update is one record, :class:`WeightUpdate` (transport, payload, targets, version). The trainer
produces the tensors (HF-named weights, or PEFT-named LoRA adapters) and holds one rank's side of the
update; this package chooses and runs the transport (:data:`~agentrl.weight_sync.registry.CONNECTORS`):

* ``disk`` (:mod:`~agentrl.weight_sync.disk`): rank 0 writes an HF (or PEFT) dir the engines load.
* ``tensor`` (:mod:`~agentrl.weight_sync.tensor`): in memory to engines on the trainer's machine (CUDA IPC
  handles, shared memory on the CPU), every rank to the engines on its own GPU.
* ``distributed`` (:mod:`~agentrl.weight_sync.broadcast`): a broadcast over a process group shared with the
  engines (NCCL from the GPU, gloo from the CPU).

With LoRA only the adapters travel; engines that serve adapters by name (SGLang) load each version under
a name of its own (:mod:`~agentrl.weight_sync.named_adapters`). Each rank's engines
(:func:`~agentrl.weight_sync.update.route`), the checks and environment a transport needs
(:mod:`~agentrl.weight_sync.rules`) and where a push's seconds went
(:func:`~agentrl.weight_sync.update.sync_phases`) live here too.

Layering: this package imports the engines' client and the trainer's tensor helpers (HF and PEFT dirs);
the trainer never imports it. The driver hands a :class:`WeightUpdate` to every trainer rank
(``MegatronTrainer.connect_engines``), which builds its side with :meth:`WeightUpdate.connect`.
"""

from typing import TYPE_CHECKING, Any

from agentrl.weight_sync.rules import SGLANG_PEER_ENV, check_transport, trainer_env
from agentrl.weight_sync.update import (
    IN_MEMORY,
    LORA_NAME,
    BroadcastGroup,
    EngineSync,
    PayloadKind,
    RankSide,
    Transport,
    WeightUpdate,
    payload_kind,
    route,
    sync_phases,
)

if TYPE_CHECKING:
    from agentrl.weight_sync.registry import CONNECTORS, RankSync, connect

# the transports' implementations (torch, the engines' client) load on first use, so that the driver and a
# run's config, which need only the record and the rules, start without torch
_REGISTRY = ("CONNECTORS", "RankSync", "connect")


def __getattr__(name: str) -> Any:
    if name in _REGISTRY:
        from agentrl.weight_sync import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CONNECTORS",
    "IN_MEMORY",
    "LORA_NAME",
    "SGLANG_PEER_ENV",
    "BroadcastGroup",
    "EngineSync",
    "PayloadKind",
    "RankSide",
    "RankSync",
    "Transport",
    "WeightUpdate",
    "check_transport",
    "connect",
    "payload_kind",
    "route",
    "sync_phases",
    "trainer_env",
]
