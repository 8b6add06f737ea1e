"""Named tensors handed to an engine on the same machine without copying them through disk or a socket:
the payload of SGLang's ``/update_weights_from_tensor``.

SGLang's request carries ``serialized_named_tensors``, one string per tensor-parallel rank: the base64
of a ``ForkingPickler`` pickle (default protocol) of ``[(name, tensor), ...]``, which is what SGLang's
``MultiprocessingSerializer.serialize(..., output_str=True)`` makes and what its restricted unpickler
(torch and multiprocessing globals only) reads back. For CUDA tensors that pickle holds CUDA IPC
handles (``torch.multiprocessing.reductions``), so the engine maps the trainer's GPU memory and copies
from it on the device. :func:`pack_named_tensors` first lays every tensor into one contiguous buffer (one
IPC handle for all of them, which the receiver opens once) and sends views of it; a real SGLang server
reads that payload as it reads any other (``load_format`` unset).

CPU tensors cannot travel that way between unrelated processes (torch shares them by file descriptor,
through a socket only the sender's own children may use). On the CPU the buffer is a POSIX shared-memory
block instead and the payload is JSON naming it and each tensor's dtype, shape and offset
(``load_format: "shared_memory"``, understood by the embedded engine only); it is what the CPU tests run.

Either way the sender keeps the buffer until the engine has answered (:meth:`PackedTensors.close`
afterwards), and the engine copies out of it before answering. Unpickling runs a restricted unpickler
that rebuilds tensors and nothing else; the endpoint still belongs behind the engine's API key, as in
SGLang.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

import torch

__all__ = ["SHARED_MEMORY", "PackedTensors", "pack_named_tensors", "unpack_named_tensors"]

SHARED_MEMORY = "shared_memory"
_ALIGN = 256  # every tensor starts at a multiple of this many bytes: any dtype view of the buffer is aligned


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layout(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for _, t in named:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


def _flat_copy(named: Sequence[tuple[str, torch.Tensor]], flat: torch.Tensor, offsets: list[int]) -> None:
    for (_, t), off in zip(named, offsets, strict=True):
        n = t.numel() * t.element_size()
        flat[off : off + n].view(t.dtype).view(t.shape).copy_(t.detach())


@dataclass
class PackedTensors:
    """One pack: ``payload`` (for ``serialized_named_tensors``) and ``load_format``; keep it alive until
    the engine answered, then :meth:`close` it."""

    payload: str
    load_format: str | None
    num_bytes: int
    _keep: list[Any] = field(default_factory=list, repr=False)

    def close(self) -> None:
        """Free the buffer (and, for shared memory, remove the block's name)."""
        for obj in self._keep:
            if isinstance(obj, shared_memory.SharedMemory):
                obj.close()
                try:
                    obj.unlink()
                except FileNotFoundError:
                    pass
        self._keep = []


def pack_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> PackedTensors:
    """Lay ``named`` into one buffer on their device and describe it for the engine (see the module
    docstring). All tensors must be on one device."""
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        raise ValueError(f"named tensors on several devices: {sorted(map(str, devices))}")
    device = next(iter(devices)) if devices else torch.device("cpu")
    offsets, total = _layout(named)
    if device.type == "cuda":
        from multiprocessing.reduction import ForkingPickler

        flat = torch.empty(total, dtype=torch.uint8, device=device)
        _flat_copy(named, flat, offsets)
        torch.cuda.current_stream(device).synchronize()  # the engine reads it from another process
        views = [
            (name, flat[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
            for (name, t), off in zip(named, offsets, strict=True)
        ]
        # Exactly the bytes of SGLang's MultiprocessingSerializer.serialize(views, output_str=True): a
        # ForkingPickler at the default protocol, then base64 (sglang need not be importable here).
        buf = io.BytesIO()
        ForkingPickler(buf).dump(views)
        return PackedTensors(base64.b64encode(buf.getvalue()).decode(), None, total, [flat, views])
    if device.type != "cpu":
        raise ValueError(f"named tensors on {device}: only CUDA (IPC handles) and CPU (shared memory)")
    shm = shared_memory.SharedMemory(create=True, size=total)
    try:
        flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=total)
        _flat_copy(named, flat, offsets)
        del flat  # no export of shm.buf may outlive this, or the block cannot be closed
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    meta = {
        "shm": shm.name,
        "size": total,
        "tensors": [
            [name, _dtype_name(t.dtype), list(t.shape), off]
            for (name, t), off in zip(named, offsets, strict=True)
        ],
    }
    return PackedTensors(json.dumps(meta), SHARED_MEMORY, total, [shm])


# ---------------------------------------------------------------------------------------- receiving
_ALLOWED = {
    "torch.multiprocessing.reductions": {
        "rebuild_cuda_tensor",
        "rebuild_tensor",
        "rebuild_typed_storage",
        "rebuild_storage_empty",
        "rebuild_typed_storage_child",
    },
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch": {"Tensor", "Size", "UntypedStorage", "TypedStorage", "device"},
    "torch._utils": {"_rebuild_tensor_v2"},
    "collections": {"OrderedDict"},
}


def _attach(name: str) -> shared_memory.SharedMemory:
    """Open the sender's block without making this process its owner: Python's resource tracker would
    otherwise remove the block (and warn of a leak) when this process exits."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # the tracker's API is private; at worst it warns at exit
        pass
    return shm


class _TensorUnpickler(pickle.Unpickler):
    """Rebuilds tensors from torch's reductions; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"serialized_named_tensors may not reference {module}.{name}")


def unpack_named_tensors(
    payload: str | bytes, load_format: str | None = None
) -> tuple[list[tuple[str, torch.Tensor]], Callable[[], None]]:
    """The ``(name, tensor)`` list a payload describes, as views of the sender's memory, and a function
    to call once they were copied out (it lets go of the shared memory). Raises ValueError on a payload
    that is not one."""
    if load_format == SHARED_MEMORY:
        try:
            meta = json.loads(payload)
            shm = _attach(str(meta["shm"]))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as err:
            raise ValueError(f"shared-memory tensors: {type(err).__name__}: {err}") from None
        size = int(meta["size"])
        if size > shm.size:
            shm.close()
            raise ValueError(f"shared-memory block {meta['shm']!r} has {shm.size} bytes, not {size}")
        flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=size)
        out = []
        try:
            for name, dtype, shape, off in meta["tensors"]:
                dt = getattr(torch, str(dtype), None)
                if not isinstance(dt, torch.dtype):
                    raise ValueError(f"{name}: unknown dtype {dtype!r}")
                n = dt.itemsize * int(torch.Size(shape).numel())
                if not 0 <= int(off) <= size - n:
                    raise ValueError(f"{name}: bytes {off}..{int(off) + n} are outside the block ({size})")
                out.append((str(name), flat[int(off) : int(off) + n].view(dt).view(*shape)))
        except BaseException:
            del flat, out
            shm.close()
            raise

        def release() -> None:
            nonlocal flat
            out.clear()
            del flat
            try:
                shm.close()
            except BufferError:  # the caller still holds a view; the mapping goes when it does
                pass

        return out, release
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format {load_format!r} is not served (None or {SHARED_MEMORY!r})")
    raw = payload.encode() if isinstance(payload, str) else payload
    try:
        data = _TensorUnpickler(io.BytesIO(base64.b64decode(raw, validate=True))).load()
    except (ValueError, pickle.UnpicklingError, EOFError) as err:
        raise ValueError(f"serialized_named_tensors: {err}") from None
    if not isinstance(data, list) or not all(
        isinstance(x, tuple | list) and len(x) == 2 and isinstance(x[0], str) and torch.is_tensor(x[1])
        for x in data
    ):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    named = [(str(n), t) for n, t in data]

    def release_views() -> None:
        named.clear()

    return named, release_views
