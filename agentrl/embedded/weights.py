"""Weights into the embedded engine: checks, copies, checkpoint reads, broadcast groups, the update lock.

A weight update (from disk or by broadcast from the trainer) must not mix weights within a generation
step, and SGLang's contract is that it waits for in-flight requests while holding new ones back. The
:class:`DrainLock` gives that: requests hold it shared while inside the engine, an update holds it
exclusively. :class:`WeightGroups` owns the process groups of ``/init_weights_update_group`` and receives
broadcast tensors; :func:`check_weights` names every tensor that does not fit the served model before
anything is copied, so a bad update changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import torch

from agentrl.embedded.sampling import EngineBadRequest


class DrainLock:
    """Readers = requests inside the engine; the writer (a weight update) waits for them to finish and
    holds new ones back meanwhile (writer preference, so a steady request stream cannot starve updates)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.asynccontextmanager
    async def read(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self):
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


def fused_expert_name(name: str, num_experts: int) -> tuple[str, int, str] | None:
    """An HF checkpoint's per-expert tensor name (``...mlp.experts.{e}.{gate|up|down}_proj.weight``) ->
    ``(fused parameter name, expert, part)`` of transformers' fused experts (``...mlp.experts.gate_up_proj``
    / ``down_proj``); None for any other name."""
    head, sep, tail = name.partition(".mlp.experts.")
    if not sep:
        return None
    parts = tail.split(".")
    if len(parts) != 3 or not parts[0].isdigit() or parts[2] != "weight":
        return None
    e, proj = int(parts[0]), parts[1]
    if proj not in ("gate_proj", "up_proj", "down_proj") or e >= num_experts:
        return None
    fused = "gate_up_proj" if proj != "down_proj" else "down_proj"
    return f"{head}.mlp.experts.{fused}", e, proj


def _target(model: torch.nn.Module, params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The tensor an update named ``name`` writes: the parameter itself, or for a mixture-of-experts model
    one expert's slice of transformers' fused experts when ``name`` is a checkpoint's per-expert name
    (``...mlp.experts.{e}.gate_proj.weight``, as SGLang's weight updates name them)."""
    if name in params:
        return params[name].data
    num_experts = int(getattr(model.config, "num_experts", 0) or 0)
    hit = fused_expert_name(name, num_experts) if num_experts else None
    if hit is None or hit[0] not in params:
        return None
    fused, e, proj = hit
    t = params[fused].data[e]
    if proj == "down_proj":
        return t
    half = t.shape[0] // 2  # gate_up_proj: the gate rows, then the up rows
    return t[:half] if proj == "gate_proj" else t[half:]


def check_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Raise :class:`EngineBadRequest` naming the tensors that are not parameters of ``model`` or have
    another shape. (``state_dict`` names tied weights under both names.)"""
    params = model.state_dict(keep_vars=True)
    errors = []
    for n, t in tensors.items():
        dst = _target(model, params, n)
        if dst is None:
            errors.append(f"{n}: unknown")
        elif tuple(dst.shape) != tuple(t.shape):
            errors.append(f"{n}: shape {tuple(t.shape)} != {tuple(dst.shape)}")
    if errors:
        raise EngineBadRequest("weights do not fit the served model: " + "; ".join(errors[:10]))


def copy_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model``'s parameters in place (same storage: CUDA graphs stay valid). The
    caller has run :func:`check_weights` on them first (before taking the update lock)."""
    params = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, t in tensors.items():
            dst = _target(model, params, name)
            dst.copy_(t.to(device=dst.device, dtype=dst.dtype))  # type: ignore[union-attr]


def pack_parameters(model: torch.nn.Module, device: torch.device, align: int = 256) -> torch.Tensor:
    """Move ``model``'s parameters into one buffer on ``device`` (each a view at an ``align``-byte offset,
    tied parameters once) and return the buffer. One allocation is one region to release and resume when
    the engine sleeps: hundreds of separate tensors each cost a backup copy, an unmap and a map."""
    params = list(dict.fromkeys(model.parameters()))
    offsets, total = [], 0
    for p in params:
        total = -(-total // align) * align
        offsets.append(total)
        total += p.numel() * p.element_size()
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for p, at in zip(params, offsets, strict=True):
        view = flat[at : at + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view
    return flat


def load_checkpoint(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict of the HF checkpoint directory ``path``, in ``dtype``."""
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).state_dict())


class WeightGroups:
    """The engine's ends of weight-broadcast process groups (one rank each: tp_size 1)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._groups: dict[str, tuple[Any, str]] = {}

    async def join(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        name: str,
        backend: str,
    ) -> None:
        from agentrl.engine.dist import init_custom_process_group

        if name in self._groups:
            raise EngineBadRequest(f"weight update group {name!r} already exists")
        if backend == "nccl" and self.device.type != "cuda":
            raise EngineBadRequest("backend nccl needs the engine on cuda; use gloo on CPU")
        pg = await asyncio.to_thread(
            init_custom_process_group,
            backend,
            f"tcp://{master_address}:{int(master_port)}",
            int(world_size),
            int(rank_offset),
            name,
        )
        self._groups[name] = (pg, backend)

    async def leave(self, name: str, timeout: float) -> bool:
        """Leave the group; bounded: aborts it past ``timeout``. True if it was left cleanly."""
        from agentrl.engine.dist import leave_process_group

        entry = self._groups.pop(name, None)
        if entry is None:
            raise EngineBadRequest(f"no weight update group {name!r}")
        return await leave_process_group(entry[0], timeout)

    async def receive(
        self,
        name: str,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        load_format: str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Receive one broadcast of ``names`` (rank 0 sends) into new tensors: a broadcast a tensor, or
        with ``load_format: flattened_bucket`` one of their bytes, split in the same layout."""
        from agentrl.engine.dist import FLATTENED, bucket_bytes, parse_dtype, unflatten_bucket

        if name not in self._groups:
            raise EngineBadRequest(f"no weight update group {name!r}; call /init_weights_update_group first")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise EngineBadRequest("names, dtypes and shapes must have the same length")
        pg, backend = self._groups[name]
        device = self.device if backend == "nccl" else torch.device("cpu")
        try:
            specs = [
                (n, parse_dtype(d), [int(x) for x in s])
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            ]
        except ValueError as err:
            raise EngineBadRequest(str(err)) from None
        if load_format not in (None, FLATTENED):
            raise EngineBadRequest(f"load_format {load_format!r}: only {FLATTENED!r} or none")

        def receive() -> dict[str, torch.Tensor]:
            import torch.distributed as dist

            if load_format == FLATTENED:
                layout = [(dt, shape) for _, dt, shape in specs]
                flat = torch.empty(bucket_bytes(layout), dtype=torch.uint8, device=device)
                dist.broadcast(flat, src=0, group=pg)
                return dict(zip(names, unflatten_bucket(flat, layout), strict=True))
            out = {}
            for n, dt, shape in specs:
                t = torch.empty(shape, dtype=dt, device=device)
                dist.broadcast(t, src=0, group=pg)
                out[n] = t
            return out

        return await asyncio.to_thread(receive)

    def abort_all(self) -> None:
        from agentrl.engine.dist import abort_process_group

        for name in list(self._groups):
            abort_process_group(self._groups.pop(name)[0])


__all__ = [
    "DrainLock",
    "WeightGroups",
    "check_weights",
    "copy_weights",
    "fused_expert_name",
    "load_checkpoint",
]
