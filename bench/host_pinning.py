"""Pinning host memory for an offload: where the seconds go, and what transparent huge pages change.

``python bench/host_pinning.py`` (one GPU) makes ``--gb`` GB of host buffers (``--buffers`` of equal
size, as an offload makes one per tensor) several ways and times each part, in one run:

* ``torch_cache`` (the baseline): ``torch.empty(n, pin_memory=True)``, torch's pinned cache, which rounds
  each block up to a power of two and pins it in one thread;
* ``exact``: buffers of the exact size in 4 KB pages, split into its parts: the pageable allocation, the
  page faults (``--threads`` threads writing zeros) and ``cudaHostRegister``;
* ``exact_thp``: what :class:`agentrl.host_buffers.HostBuffers` does: the same with
  ``madvise(MADV_HUGEPAGE)`` on each buffer before its pages are touched (2 MB pages: 512 times fewer
  faults and page-table entries to pin), where the kernel allows it.

For each it also copies a GPU tensor of the buffers' size into them and back, so a pinned buffer that
copies at pageable speed would show. Prints one JSON line: seconds and GB/s of each part, the bytes each
way locked, the kernel's transparent huge page setting, and the ratios against the baseline. On a
CPU-only machine it exits with a message.
"""

from __future__ import annotations

import argparse
import json
import mmap
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_setting() -> str:
    """The kernel's mode, e.g. ``madvise`` from ``always [madvise] never``."""
    try:
        text = THP.read_text()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _copies(torch: Any, bufs: list[Any], gpu: Any) -> dict[str, float]:
    """GB/s of copying ``gpu`` (a uint8 CUDA tensor as big as one buffer) into every buffer and back."""
    total = sum(b.numel() for b in bufs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in bufs:
        b.copy_(gpu, non_blocking=True)
    torch.cuda.synchronize()
    d2h = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in bufs:
        gpu.copy_(b, non_blocking=True)
    torch.cuda.synchronize()
    h2d = time.perf_counter() - t0
    return {"d2h_gbps": round(total / d2h / 1e9, 2), "h2d_gbps": round(total / h2d / 1e9, 2)}


def _exact(torch: Any, sizes: list[int], threads: int, huge: bool) -> tuple[list[Any], dict[str, Any]]:
    """Buffers made as HostBuffers makes them, each part timed; ``huge``: madvise before the touch."""
    from agentrl.host_buffers import advise_huge_pages, touch_pages

    bufs, alloc_s = _timed(lambda: [torch.empty(n, dtype=torch.uint8) for n in sizes])
    advised = 0
    if huge:
        advised = sum(advise_huge_pages(b) for b in bufs)
    _, touch_s = _timed(lambda: touch_pages(bufs, threads))
    cudart = torch.cuda.cudart()

    def register() -> None:
        for b in bufs:
            err = cudart.cudaHostRegister(b.data_ptr(), b.numel(), 0)
            if int(getattr(err, "value", err)) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")

    _, register_s = _timed(register)
    gb = sum(sizes) / 1e9
    parts = {
        "alloc_s": round(alloc_s, 3),
        "touch_s": round(touch_s, 3),
        "register_s": round(register_s, 3),
        "total_s": round(alloc_s + touch_s + register_s, 3),
        "touch_gbps": round(gb / touch_s, 2),
        "register_gbps": round(gb / register_s, 2),
        "total_gbps": round(gb / (alloc_s + touch_s + register_s), 2),
        "locked_gb": round(gb, 3),
    }
    if huge:
        parts["advised_buffers"] = advised
        parts["anon_huge_gb"] = _anon_huge_gb()
    return bufs, parts


def _anon_huge_gb() -> float:
    """This process's memory in transparent huge pages (``AnonHugePages``)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return round(int(line.split()[1]) * 1024 / 1e9, 3)
    return 0.0


def _unregister(torch: Any, bufs: list[Any]) -> None:
    for b in bufs:
        torch.cuda.cudart().cudaHostUnregister(b.data_ptr())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=8.0, help="host memory to pin in each way (GB)")
    ap.add_argument("--buffers", type=int, default=16, help="buffers it is split into")
    ap.add_argument("--threads", type=int, default=8, help="threads that touch the pages")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit(
            "bench/host_pinning.py needs a GPU (cudaHostRegister); tests/test_colocate.py has the CPU paths"
        )
    size = int(args.gb * 1e9 / args.buffers) // mmap.PAGESIZE * mmap.PAGESIZE
    sizes = [size] * args.buffers
    gpu = torch.ones(size, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {
        "bench": "host_pinning",
        "gpu": torch.cuda.get_device_name(),
        "gb": round(sum(sizes) / 1e9, 3),
        "buffers": args.buffers,
        "threads": args.threads,
        "thp": _thp_setting(),
    }

    bufs, seconds = _timed(lambda: [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes])
    locked = sum(1 << (n - 1).bit_length() for n in sizes)  # the cache's power-of-two blocks
    out["torch_cache"] = {
        "total_s": round(seconds, 3),
        "total_gbps": round(sum(sizes) / seconds / 1e9, 2),
        "locked_gb": round(locked / 1e9, 3),
        **_copies(torch, bufs, gpu),
    }
    del bufs
    torch.cuda.synchronize()
    empty = getattr(torch._C, "_host_emptyCache", None)  # the cache's blocks go back before the next way
    if empty is not None:
        empty()

    for name, huge in (("exact", False), ("exact_thp", True)):
        bufs, parts = _exact(torch, sizes, args.threads, huge)
        out[name] = {**parts, **_copies(torch, bufs, gpu)}
        _unregister(torch, bufs)
        del bufs
    base = out["torch_cache"]["total_s"]
    out["speedup_vs_torch_cache"] = {
        name: round(base / out[name]["total_s"], 2) for name in ("exact", "exact_thp")
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
