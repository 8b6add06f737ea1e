"""Weight updates into the running embedded engine: SGLang's ``update_weights_from_tensor``,
``update_weights_from_disk`` and ``update_weights_from_distributed`` (with its group's join and leave).

Every update takes the same step (:meth:`WeightUpdates.apply`): abort the requests in flight if asked,
wait at the gate's drain for those inside to finish while holding new ones (:mod:`agentrl.embedded.gate`),
copy the weights in place on the device thread (CUDA graphs stay valid; fp8 copies quantized again),
clear the prefix cache and set the engine's ``weight_version``; so no request mixes weights within a step
and no KV computed with old weights is reused. The transports differ only in how the tensors arrive:
views of the sender's memory, a checkpoint directory, or a broadcast from the trainer.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from agentrl.embedded import fp8
from agentrl.embedded.gate import RequestGate
from agentrl.embedded.lora import LoraServing, is_adapter_tensor
from agentrl.embedded.memory import EngineMemory
from agentrl.embedded.runner import ModelRunner
from agentrl.embedded.sampling import EngineBadRequest
from agentrl.embedded.scheduler import Scheduler
from agentrl.embedded.weights import WeightGroups, check_weights, copy_weights, load_checkpoint


class UpdatableEngine(Protocol):
    """What weight updates use of the engine (:class:`~agentrl.embedded.engine.EmbeddedEngine`): its
    parts, its device thread (``_on_device``), its abort and its LoRA endpoints' adapter loading
    (``_apply_adapter``); they set its ``weight_version`` and, from disk, its ``model_path``."""

    model: torch.nn.Module
    runner: ModelRunner
    memory: EngineMemory
    scheduler: Scheduler
    gate: RequestGate
    lora: LoraServing
    device: torch.device
    dtype: torch.dtype
    quantization: str | None
    stats: dict[str, Any]
    weight_version: str
    model_path: str

    def abort(self, rid: str | None = None) -> int: ...

    def _on_device(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future: ...

    async def _apply_adapter(
        self,
        lora_name: str,
        config: dict,
        tensors: dict[str, torch.Tensor],
        abort_all: bool,
        weight_version: str | None,
        flush: bool,
    ) -> None: ...


class WeightUpdates:
    """The weight updates of one engine (see the module docstring). ``groups``: the distributed groups the
    engine has joined."""

    def __init__(self, engine: UpdatableEngine) -> None:
        self.engine = engine
        self.groups = WeightGroups(engine.device)

    async def apply(
        self, apply: Callable[[], None], abort_all: bool, weight_version: str | None, flush: bool = True
    ) -> None:
        """The step every update takes: ``apply`` (which writes the weights) run on the device thread while
        no request is inside the engine and no step runs (see the module docstring)."""
        engine = self.engine
        self.check_resident()
        if abort_all:
            engine.abort(None)
        async with engine.gate.drain.write(), engine.scheduler.step_lock:
            await engine._on_device(apply)
            if flush:
                engine.scheduler.flush_prefix_cache()
            if weight_version is not None:
                engine.weight_version = str(weight_version)

    def requantize(self) -> None:
        """Device thread: after an update wrote the weights, the fp8 copies quantized from them again."""
        if self.engine.quantization is not None:
            self.engine.stats["quantize_s"] = fp8.requantize(self.engine.runner.weights)

    def check_resident(self) -> None:
        if "weights" in self.engine.memory.released:
            raise EngineBadRequest(
                "the weights are released (release_memory_occupation): resume_memory_occupation with "
                "tags ['weights'] first, then update them"
            )

    def replace_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Device thread: copy ``tensors`` into the model's parameters (the new base weights)."""
        copy_weights(self.engine.model, tensors)
        self.engine.lora.forget(list(tensors))  # these are the new base weights
        self.requantize()

    async def unpacked(self, payload: str, load_format: str | None) -> tuple:
        """The named tensors of an in-memory payload, mapped on the device thread, and their release."""
        from agentrl.engine.named_tensors import unpack_named_tensors

        def unpack():  # a malformed payload is the client's error
            try:
                return unpack_named_tensors(payload, load_format)
            except ValueError as err:
                raise EngineBadRequest(str(err)) from None

        return await self.engine._on_device(unpack)

    async def from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None,
        weight_version: str | None,
        abort_all: bool,
        flush: bool = True,
    ) -> None:
        """``/update_weights_from_tensor``: the tensors arrive as views of the sender's memory (CUDA IPC
        handles, or shared memory on the CPU: :mod:`agentrl.engine.named_tensors`); they are checked,
        copied in place and let go of before this returns."""
        if not isinstance(serialized_named_tensors, list) or len(serialized_named_tensors) != 1:
            raise EngineBadRequest(
                "serialized_named_tensors must be a list with one entry per tensor-parallel rank (tp_size 1)"
            )
        self.check_resident()  # before mapping anything
        named, release = await self.unpacked(serialized_named_tensors[0], load_format)
        try:
            tensors = dict(named)
            check_weights(self.engine.model, tensors)
            device = self.engine.device

            def apply() -> None:
                self.replace_weights(tensors)
                if device.type == "cuda":  # done reading the sender's memory before it is freed
                    torch.cuda.synchronize(device)

            await self.apply(apply, abort_all, weight_version, flush)
        finally:
            tensors = named = None
            await self.engine._on_device(release)

    async def from_disk(
        self, model_path: str, weight_version: str | None, abort_all: bool, flush: bool = True
    ) -> None:
        """``/update_weights_from_disk``: a HF checkpoint directory."""
        engine = self.engine
        path = Path(model_path)
        if not await asyncio.to_thread(path.is_dir):
            raise EngineBadRequest(f"model_path {model_path!r} is not a directory")
        # Read the checkpoint before taking the lock: on a GPU generation continues meanwhile; on CPU the read
        # (torch work) runs on the device thread, between steps.
        load = functools.partial(load_checkpoint, path, engine.dtype)
        try:
            tensors = await (
                asyncio.to_thread(load) if engine.device.type == "cuda" else engine._on_device(load)
            )
        except (OSError, ValueError) as err:
            raise EngineBadRequest(f"cannot load weights from {model_path!r}: {err}") from None
        check_weights(engine.model, tensors)
        await self.apply(lambda: self.replace_weights(tensors), abort_all, weight_version, flush)
        engine.model_path = str(path)

    async def from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        abort_all: bool,
        flush: bool = True,
        load_format: str | None = None,
    ) -> None:
        """``/update_weights_from_distributed``: the tensors broadcast by the trainer in the group
        ``group_name`` (``load_format: flattened_bucket``: as one broadcast of their bytes); a LoRA
        adapter's tensors (sent whole in one call) load as the adapter."""
        # Receive first (the trainer is blocked in broadcast until we do), even if the names turn out to be
        # wrong: refusing before receiving would leave the trainer hanging in its collective.
        tensors = await self.groups.receive(group_name, names, dtypes, shapes, load_format)
        adapter = [is_adapter_tensor(n) for n in tensors]
        if any(adapter):  # a LoRA adapter, sent whole in one call, its B scaled already
            if not all(adapter):
                raise EngineBadRequest("an update holds LoRA tensors and weights together; send them apart")
            scaled = {"r": 1, "lora_alpha": 1.0}
            await self.engine._apply_adapter("broadcast", scaled, tensors, abort_all, weight_version, flush)
            return
        check_weights(self.engine.model, tensors)
        await self.apply(lambda: self.replace_weights(tensors), abort_all, weight_version, flush)


__all__ = ["WeightUpdates"]
