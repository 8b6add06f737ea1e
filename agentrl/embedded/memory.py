"""The embedded engine's releasable GPU memory: its weights and its KV cache, by SGLang's tags.

``/release_memory_occupation`` and ``/resume_memory_occupation`` take ``tags`` (``"weights"``,
``"kv_cache"``; none means both). :class:`EngineMemory` does the freeing and the giving back, one of two
ways:

* **virtual** (a GPU with ``torch_memory_saver``): the weights and the KV cache are allocated inside a
  memory-saver region per tag, in CUDA virtual memory. Releasing unmaps the physical memory and keeps
  the virtual addresses; resuming maps new memory at the same addresses, so the captured decode CUDA
  graphs stay valid. The weights keep a pinned host copy (:class:`agentrl.storage_offload.HostCopy`, restored
  on resume; the memory saver's own backup copies through pageable memory, 0.34-0.40 s for 0.99 GB of
  weights on an H100); the KV cache does not (its entries are recomputed; it is zeroed on resume, since
  masked keys still enter the attention sums).
* **copy** (the fallback, and the CPU): :class:`agentrl.storage_offload.StorageOffload` copies the weights to
  pinned host memory and frees their storages, and frees the KV cache's. Resuming allocates them again,
  at new addresses: the CUDA graphs are dropped and captured again as buckets are next used.

``mode="auto"`` picks virtual on a GPU when ``torch_memory_saver`` imports and works, else copy.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch

from agentrl.storage_offload import HostCopy, StorageOffload

log = logging.getLogger("agentrl.engine")

TAGS = ("weights", "kv_cache")
MemoryMode = Literal["auto", "virtual", "copy"]

__all__ = ["TAGS", "EngineMemory", "MemoryMode"]


def _memory_saver() -> Any:
    """A fresh ``torch_memory_saver`` instance in its in-process (pluggable allocator) mode; raises
    ImportError / RuntimeError when it cannot work here."""
    from torch_memory_saver import TorchMemorySaver

    saver = TorchMemorySaver()
    saver.hook_mode = "torch"  # no LD_PRELOAD: a torch MemPool over its allocator
    with saver.region(tag="probe"):  # fails now, not at the first real allocation
        torch.empty(1, device="cuda")
    atexit.register(_frees_allowed_at_exit, saver)
    return saver


def _frees_allowed_at_exit(saver: Any) -> None:
    """The memory saver's allocator refuses a free outside a region ("tms_torch_free ... only support
    interesting region") and ends the process with status 1; the interpreter's exit frees its pools' blocks
    outside any region, so a program that worked would exit 1. Mark the exiting thread as inside a region:
    those last frees are ordinary frees of the saver's virtual memory."""
    try:
        saver._impl._binary_wrapper.cdll.tms_set_interesting_region(True)
    except AttributeError as err:  # the saver's internals moved: the exit status may be 1 again
        log.warning("cannot allow torch_memory_saver's frees at exit (%s)", err)


class EngineMemory:
    """The engine's weights and KV cache, released and resumed by tag (see the module docstring)."""

    def __init__(self, device: torch.device, mode: MemoryMode = "auto") -> None:
        self.device = device
        self.saver: Any = None
        if mode in ("auto", "virtual") and device.type == "cuda":
            try:
                self.saver = _memory_saver()
            except Exception as err:  # ImportError, or a CUDA / allocator mismatch
                if mode == "virtual":
                    raise RuntimeError(f"torch_memory_saver does not work here: {err}") from err
                log.warning("torch_memory_saver unavailable (%s); releasing memory by copy", err)
        elif mode == "virtual":
            raise RuntimeError("memory mode virtual needs a CUDA device")
        self.mode: str = "virtual" if self.saver is not None else "copy"
        self.released: set[str] = set()
        self._tensors: dict[str, list[torch.Tensor]] = {}
        self._copies: dict[str, StorageOffload] = {}
        self._saved: dict[str, HostCopy] = {}  # virtual mode: the weights' bytes across a release
        self.sizes: dict[str, int] = {}  # device bytes of each tag when resident
        self.last_seconds: dict[str, float] = {}

    @property
    def addresses_stable(self) -> bool:
        """Whether resumed memory sits at its old addresses (CUDA graphs stay valid)."""
        return self.mode == "virtual"

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        """Allocate ``tag``'s tensors inside this (a memory-saver region in virtual mode; else nothing)."""
        if self.saver is None:
            yield
            return
        with self.saver.region(tag=tag, enable_cpu_backup=False):  # the weights are saved by HostCopy
            yield

    def register(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        """The tensors of ``tag`` (allocated inside :meth:`region` in virtual mode)."""
        if tag not in TAGS:
            raise ValueError(f"unknown memory tag {tag!r}; the tags are {', '.join(TAGS)}")
        self._tensors[tag] = list(tensors)
        offload = StorageOffload(self._tensors[tag], keep=tag == "weights")
        self.sizes[tag] = offload.nbytes
        if self.saver is None:
            self._copies[tag] = offload
        elif tag == "weights":
            self._saved[tag] = HostCopy(self._tensors[tag])

    def release(self, tag: str) -> None:
        """Free ``tag``'s device memory (device thread; the caller checked it is not released)."""
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no kernel may still read what goes
        if self.saver is not None:
            if tag in self._saved:
                self._saved[tag].save()
            self.saver.pause(tag)
        else:
            self._copies[tag].offload()
        if self.device.type == "cuda":
            # back to the driver, for the trainer's process: in copy mode the tensors' own blocks, in both
            # modes the blocks the allocator cached for prefill activations (GiBs after large steps;
            # CUDA graphs keep their private pool)
            torch.cuda.empty_cache()
        self.released.add(tag)
        self.last_seconds[f"release_{tag}"] = time.perf_counter() - t0

    def resume(self, tag: str) -> None:
        """Give ``tag``'s memory back: weights with their content, the KV cache zeroed (device thread)."""
        t0 = time.perf_counter()
        if self.saver is not None:
            self.saver.resume(tag)
            if tag in self._saved:
                self._saved[tag].restore()
        else:
            self._copies[tag].onload()
        if tag == "kv_cache":  # keys and values zeroed; integer entries (MoE experts) -1: not computed
            for t in self._tensors.get(tag, ()):
                t.zero_() if t.is_floating_point() else t.fill_(-1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.released.discard(tag)
        self.last_seconds[f"resume_{tag}"] = time.perf_counter() - t0
