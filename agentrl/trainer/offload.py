"""What a trainer rank does to share its GPU with an inference engine (``placement: colocated``):
:class:`TrainerOffload` moves the rank's weights, optimizer state (fp32 main weights, Adam moments) and a
KL reference model's weights to pinned host memory while the engine generates, and back before the next
step (:mod:`agentrl.storage_offload`, content kept bit for bit); the gradients (megatron's contiguous buffers
included) are freed and come back as zeros, since every update zeroes them first. Storages shared by
several tensors (megatron's parameters are views of one buffer) move once. The new weights reach the
engine in memory (:mod:`agentrl.weight_sync.tensor`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from agentrl.host_buffers import HostBuffers
from agentrl.storage_offload import StorageOffload

__all__ = ["TrainerOffload", "trainer_state_tensors"]


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Parameters and state tensors of a torch optimizer, or of every torch optimizer inside megatron's
    (chained / distributed) optimizer."""
    stack = [optimizer]
    seen: set[int] = set()
    while stack:
        o = stack.pop()
        if o is None or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.optim.Optimizer):
            for group in o.param_groups:
                yield from group["params"]
            for state in o.state.values():
                yield from (v for v in state.values() if torch.is_tensor(v))
        chained = getattr(o, "chained_optimizers", None)
        if chained is not None:
            # megatron's chain (dense and expert-parallel parameters each have an optimizer): its own
            # .optimizer is only defined for a chain of one
            stack.extend(chained)
            continue
        stack.extend(getattr(o, "sub_optimizers", []))  # megatron's hybrid CPU/GPU optimizer
        stack.append(getattr(o, "optimizer", None))


def trainer_state_tensors(
    model: torch.nn.Module, optimizer: Any, extra: list[torch.nn.Module]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A rank's training state as (kept, gradients): the (DDP-wrapped) model's parameters and buffers,
    megatron DDP's parameter buffers, the optimizer's parameters and state and the parameters of
    ``extra`` modules (a reference model); and the gradients (``.grad``, megatron's ``main_grad`` and
    DDP gradient buffers), which every update zeroes before it accumulates, so their content need not
    survive an offload."""
    kept: list[torch.Tensor | None] = []
    grads: list[torch.Tensor | None] = []
    for m in [model, *extra]:
        for p in m.parameters():
            kept.append(p)
            grads += [p.grad, getattr(p, "main_grad", None)]
        kept += [b for _, b in m.named_buffers()]
    for attr in ("buffers", "expert_parallel_buffers"):  # megatron DDP: lists of param-and-grad buffers
        bufs = getattr(model, attr, None)
        if isinstance(bufs, list):
            for b in bufs:
                kept.append(getattr(b, "param_data", None))
                grads.append(getattr(b, "grad_data", None))
    kept += list(_optimizer_tensors(optimizer))
    return [t for t in kept if t is not None], [t for t in grads if t is not None]


class TrainerOffload:
    """The training state of one rank on ``device``, off the device and back (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        device: torch.device,
        extra: list[torch.nn.Module] | None = None,
        host: HostBuffers | None = None,
    ) -> None:
        self.device = device
        self.host = host if host is not None else HostBuffers()
        kept, grads = trainer_state_tensors(model, optimizer, extra or [])
        self.state = StorageOffload([t for t in kept if t.device == device], keep=True, host=self.host)
        held = {s.data_ptr() for s in self.state.storages}
        grads = [t for t in grads if t.device == device and t.untyped_storage().data_ptr() not in held]
        self.grads = StorageOffload(grads, keep=False)  # freed, and zeros when they come back

    @property
    def offloaded(self) -> bool:
        return self.state.offloaded

    def offload(self) -> dict[str, float]:
        """Move the state to host memory, free it and the gradients on the device (no-op if done). The
        figures add the seconds spent making new host buffers (``offload_host_alloc_s``: the first
        offload, and the first after the optimizer's state appears) and the host memory they hold."""
        alloc = self.host.alloc_seconds
        stats = self.state.offload()
        grads = self.grads.offload()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver, where the engine's process can take it
        out = self._report("offload", stats.bytes + grads.bytes, stats.seconds + grads.seconds)
        out["offload_host_alloc_s"] = self.host.alloc_seconds - alloc
        out["offload_host_gb"] = self.host.held_bytes / 2**30
        return out

    def onload(self) -> dict[str, float]:
        """Bring the state back and the gradient memory (zeroed) (no-op if it is on the device)."""
        stats = self.state.onload()
        grads = self.grads.onload()
        return self._report("onload", stats.bytes + grads.bytes, stats.seconds + grads.seconds)

    def _report(self, what: str, nbytes: int, seconds: float) -> dict[str, float]:
        out = {f"{what}_gb": nbytes / 2**30, f"{what}_s": seconds}
        if self.device.type == "cuda":
            out["gpu_mem_allocated_gb"] = torch.cuda.memory_allocated(self.device) / 2**30
            out["gpu_mem_reserved_gb"] = torch.cuda.memory_reserved(self.device) / 2**30
        return out
