"""Taking tensors' memory off their device and giving it back, keeping the tensor objects.

When an engine and a trainer take turns on one GPU, each frees what it holds while the other works.
:class:`StorageOffload` does it at the level of storages: ``offload()`` copies each storage to host
memory (pinned on a GPU, when its content must survive) and shrinks the storage to zero bytes;
``onload()`` grows it back and copies the content in (or zeroes it when the content was dropped). The host
buffers are exact-size ones from a :class:`agentrl.host_buffers.HostBuffers` pool, which keeps the pinned
ones for the next offload. Every
tensor, view and ``nn.Parameter`` that shares a storage keeps working afterwards: megatron's parameters,
which are views into one contiguous buffer, come back with that buffer. What changes is the device
address of the memory (the caching allocator picks new blocks), so a CUDA graph that captured the old
addresses must be captured again; CUDA virtual memory (``torch_memory_saver``, see
:mod:`agentrl.embedded.memory`) is the way to keep them.

It works on any device, the CPU included, where it still frees the memory and restores the content bit
for bit, which is what the CPU tests check.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from agentrl.host_buffers import HostBuffers

__all__ = ["HostCopy", "OffloadStats", "StorageOffload", "unique_storages"]


def unique_storages(tensors: Iterable[torch.Tensor | None]) -> list[torch.UntypedStorage]:
    """The distinct storages behind ``tensors`` (shared storages once; None and empty ones skipped)."""
    seen: set[int] = set()
    out: list[torch.UntypedStorage] = []
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        key = s.data_ptr()
        if s.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out.append(s)
    return out


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``'s bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


@dataclass
class OffloadStats:
    """What the last offload or onload moved: storages, bytes and seconds (device synchronised)."""

    storages: int = 0
    bytes: int = 0
    seconds: float = 0.0


class StorageOffload:
    """A fixed set of tensors whose storages go off the device and come back (see the module docstring).

    ``keep``: whether the content survives (weights, optimizer state) or is dropped and zeroed on
    :meth:`onload` (a KV cache, whose entries are recomputed). The storages are collected when the object
    is built; tensors created later are not covered. ``host``: the pool the host copies come from and go
    back to (one of its own by default; share one to keep buffers across offload objects).
    """

    def __init__(
        self, tensors: Iterable[torch.Tensor | None], keep: bool = True, host: HostBuffers | None = None
    ) -> None:
        self.storages = unique_storages(tensors)
        self.keep = keep
        self.host = host if host is not None else HostBuffers()
        self.sizes = [s.nbytes() for s in self.storages]
        self._host: list[torch.Tensor | None] = []
        self.offloaded = False
        self.last = OffloadStats()

    @property
    def nbytes(self) -> int:
        """Bytes the storages hold on their device when onloaded."""
        return sum(self.sizes)

    def offload(self) -> OffloadStats:
        """Copy the content to host memory (if kept) and free the device memory. A second call is a no-op."""
        if self.offloaded:
            return OffloadStats()
        t0 = time.perf_counter()
        self._host = [None] * len(self.storages)
        if self.keep:
            for pin in (False, True):  # host memory for every storage first: new buffers are made together
                mine = [i for i, s in enumerate(self.storages) if (s.device.type == "cuda") == pin]
                bufs = self.host.take_all([self.sizes[i] for i in mine], pin)
                for i, buf in zip(mine, bufs, strict=True):
                    self._host[i] = buf
                    buf.copy_(_bytes_view(self.storages[i]), non_blocking=pin)
        self._sync()  # the copies must be done before the memory goes
        for s in self.storages:
            s.resize_(0)
        self.offloaded = True
        self.last = OffloadStats(len(self.storages), self.nbytes, time.perf_counter() - t0)
        return self.last

    def onload(self) -> OffloadStats:
        """Give the memory back and restore the content (zeros if it was not kept). No-op if not offloaded."""
        if not self.offloaded:
            return OffloadStats()
        t0 = time.perf_counter()
        for s, n, host in zip(self.storages, self.sizes, self._host, strict=True):
            s.resize_(n)
            view = _bytes_view(s)
            if host is None:
                view.zero_()
            else:
                view.copy_(host, non_blocking=s.device.type == "cuda")
        self._sync()  # the host buffers are free once the copies are done
        for s, host in zip(self.storages, self._host, strict=True):
            if host is not None:
                self.host.give(host, s.device.type == "cuda")
        self._host = []
        self.offloaded = False
        self.last = OffloadStats(len(self.storages), self.nbytes, time.perf_counter() - t0)
        return self.last

    def _sync(self) -> None:
        _synchronize(self.storages)


class HostCopy:
    """The bytes of a fixed set of storages, saved to host memory (pinned on a GPU, exact-size buffers
    allocated once and kept) and written back, the storages themselves untouched: for memory that
    something else frees and maps again at the same addresses (CUDA virtual memory,
    :mod:`agentrl.embedded.memory`)."""

    def __init__(self, tensors: Iterable[torch.Tensor | None]) -> None:
        self.storages = unique_storages(tensors)
        self.host = HostBuffers()
        self._host: list[torch.Tensor] = []

    def save(self) -> None:
        """Copy the storages' bytes to host memory (the copies are done when this returns)."""
        if not self._host:
            self._host = [self.host.take(s.nbytes(), s.device.type == "cuda") for s in self.storages]
        for s, host in zip(self.storages, self._host, strict=True):
            host.copy_(_bytes_view(s), non_blocking=s.device.type == "cuda")
        _synchronize(self.storages)

    def restore(self) -> None:
        """Write the saved bytes back into the storages (done when this returns)."""
        for s, host in zip(self.storages, self._host, strict=True):
            _bytes_view(s).copy_(host, non_blocking=s.device.type == "cuda")
        _synchronize(self.storages)


def _synchronize(storages: list[torch.UntypedStorage]) -> None:
    for d in {s.device for s in storages if s.device.type == "cuda"}:
        torch.cuda.synchronize(d)
