"""Copies of cached positions between KV slots, many at once: one launch per wave of independent copies.

The scheduler queues slot copies between steps (a prefix hit into a running slot, a finished sequence
into the prefix cache, the last running slot into a freed one) and the runner applies them, in order,
before the next forward. A turn of an agent episode makes about three, so a rollout step of a few
hundred turns makes hundreds. As ``tensor.copy_`` calls each copy was a strided copy over all layers of
a cache larger than 2**31 elements, which torch splits into several 32-bit-indexed kernels, each with
its own host-side setup: about 0.12 ms of host time per copy on a GPU, enough to show in a profile of
the engine.

:func:`copy_waves` cuts the ordered list into **waves**: runs of consecutive copies in which no slot is
both read and written and no slot is written twice, so that the copies of one wave may run in any order,
or all at once, and give what running the list one by one gives. On a GPU :func:`copy_slots` runs each
wave as one Triton launch over both caches, one program per (copy, layer and KV head, block of
positions). On the CPU, or for the MoE routing table beside the cache, the copies run one by one.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU engines copy with torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

Copy = tuple[int, int, int, int]  # (source slot, destination slot, end position, start position)

BLOCK_T = 32  # positions per program


def copy_waves(copies: list[Copy]) -> list[list[Copy]]:
    """``copies`` (applied in order, ``(src, dst, n, start)``: positions ``start..n-1``) cut into waves of
    consecutive copies that are independent: within a wave no slot is a source and a destination, and no
    destination repeats. Empty copies (nothing to move, or a slot onto itself) are dropped."""
    waves: list[list[Copy]] = []
    reads: set[int] = set()
    writes: set[int] = set()
    for c in copies:
        src, dst, n, start = c
        if n <= start or src == dst:
            continue
        if not waves or src in writes or dst in writes or dst in reads:
            waves.append([])
            reads, writes = set(), set()
        waves[-1].append(c)
        reads.add(src)
        writes.add(dst)
    return waves


if triton is not None:

    @triton.jit
    def _copy_kernel(
        k_ptr,
        v_ptr,
        table_ptr,
        s_layer,
        s_slot,
        s_head,
        HEADS: tl.constexpr,
        D: tl.constexpr,
        BT: tl.constexpr,
    ):
        c = tl.program_id(0)
        lh = tl.program_id(1).to(tl.int64)
        tb = tl.program_id(2)
        src = tl.load(table_ptr + 4 * c).to(tl.int64)
        dst = tl.load(table_ptr + 4 * c + 1).to(tl.int64)
        n = tl.load(table_ptr + 4 * c + 2).to(tl.int64)
        start = tl.load(table_ptr + 4 * c + 3).to(tl.int64)
        t = start + tb * BT + tl.arange(0, BT).to(tl.int64)
        live = (t < n)[:, None]  # a copy shorter than the wave's longest has idle blocks
        base = (lh // HEADS) * s_layer + (lh % HEADS) * s_head
        cols = t[:, None] * D + tl.arange(0, D)[None, :]
        at_src = base + src * s_slot + cols
        at_dst = base + dst * s_slot + cols
        tl.store(k_ptr + at_dst, tl.load(k_ptr + at_src, mask=live), mask=live)
        tl.store(v_ptr + at_dst, tl.load(v_ptr + at_src, mask=live), mask=live)


def _one_by_one(k: torch.Tensor, v: torch.Tensor, copies: list[Copy]) -> None:
    for src, dst, n, start in copies:
        k[:, dst, :, start:n].copy_(k[:, src, :, start:n])
        v[:, dst, :, start:n].copy_(v[:, src, :, start:n])


def copy_slots(k: torch.Tensor, v: torch.Tensor, copies: list[Copy]) -> int:
    """Apply ``copies`` in order to the caches ``k`` and ``v`` (``[layers, slots, kv_heads, positions,
    head_dim]``, contiguous, the same shape); returns the number of launches (waves) on a GPU, else 0."""
    waves = copy_waves(copies)
    if not waves:
        return 0
    d = k.shape[-1]
    fused = k.is_cuda and triton is not None and k.is_contiguous() and v.is_contiguous() and d & (d - 1) == 0
    if not fused:
        _one_by_one(k, v, [c for w in waves for c in w])
        return 0
    layers, _, heads = k.shape[:3]
    flat = torch.tensor([x for w in waves for c in w for x in c], dtype=torch.int32).pin_memory()
    table = flat.to(k.device, non_blocking=True)
    at = 0
    for wave in waves:
        longest = max(n - start for _, _, n, start in wave)
        grid = (len(wave), layers * heads, triton.cdiv(longest, BLOCK_T))
        _copy_kernel[grid](
            k, v, table[4 * at :], k.stride(0), k.stride(1), k.stride(2), HEADS=heads, D=d, BT=BLOCK_T
        )
        at += len(wave)
    return len(waves)


__all__ = ["BLOCK_T", "Copy", "copy_slots", "copy_waves"]
