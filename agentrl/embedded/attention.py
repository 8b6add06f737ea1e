"""Prefill attention on a GPU straight from the slot KV cache, over packed tokens (no padding).

A prefill step's rows add different numbers of tokens after different numbers of cached ones: an agent's
next turn adds an observation after thousands of cached tokens, a fresh prompt adds hundreds after none.
Laid out as a rectangle (rows x the widest row) most cells are padding, and attending over cached keys
needs them gathered out of the cache with a mask beside them. Here the step's tokens are packed end to
end, ``[tokens, heads, head_dim]``, and one Triton program per (block of up to ``BLOCK_M`` tokens of one
row, query head) walks that row's keys ``0..`` in the slot cache in blocks of ``BLOCK_N``, with the
online softmax of flash attention and the causal mask on each query's own position. The step's new keys
are written to the cache first, so cached and new keys are read alike. Without a GPU the same blocks go
through torch SDPA one by one (the reference the tests hold the layout to).

Not batch-invariant (the deterministic mode has its own kernel in :mod:`agentrl.batch_invariant`), but
deterministic: no atomics, and each query's keys are reduced in one fixed order.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU engines never call into this module's kernel
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

BLOCK_M = 64  # query tokens of one row per program
BLOCK_N = 64  # keys per inner step


def available(head_dim: int) -> bool:
    """Whether the packed kernel serves this head size on this install (Triton present, power-of-two
    head_dim of at least 16, as ``tl.dot`` needs)."""
    return triton is not None and head_dim >= 16 and head_dim & (head_dim - 1) == 0


if triton is not None:

    @triton.jit
    def _extend_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        meta_ptr,
        meta_stride,
        sq_t,
        sq_h,
        sk_s,
        sk_h,
        sk_l,
        sv_s,
        sv_h,
        sv_l,
        so_t,
        so_h,
        qk_scale,
        G: tl.constexpr,
        D: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        blk = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        # meta [4, blocks]: the block's slot, its first token's index in q, its token count (0: a padding
        # block, which stores nothing), its first token's position in the sequence
        slot = tl.load(meta_ptr + blk).to(tl.int64)
        tok0 = tl.load(meta_ptr + meta_stride + blk).to(tl.int64)
        n = tl.load(meta_ptr + 2 * meta_stride + blk).to(tl.int32)
        pos0 = tl.load(meta_ptr + 3 * meta_stride + blk).to(tl.int32)
        m = tl.arange(0, BM)
        d = tl.arange(0, D)
        live = m < n
        q = tl.load(q_ptr + (tok0 + m)[:, None] * sq_t + h * sq_h + d[None, :], mask=live[:, None], other=0.0)
        q_pos = pos0 + m
        kvh = h // G
        kb = k_ptr + slot * sk_s + kvh * sk_h
        vb = v_ptr + slot * sv_s + kvh * sv_h
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, D], dtype=tl.float32)
        end = pos0 + n  # keys 0..end-1: the cached ones and this step's
        for start in range(0, end, BN):
            j = start + tl.arange(0, BN)
            inside = j < end
            k = tl.load(kb + j[:, None] * sk_l + d[None, :], mask=inside[:, None], other=0.0)
            if IEEE:  # fp32 models: full-precision products, not TF32
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            else:
                s = tl.dot(q, tl.trans(k)) * qk_scale  # log2 units: exp2 below
            s = tl.where(j[None, :] <= q_pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vb + j[:, None] * sv_l + d[None, :], mask=inside[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(
            o_ptr + (tok0 + m)[:, None] * so_t + h * so_h + d[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=live[:, None],
        )


def block_table(slots: list[int], lens: list[int], start: list[int]) -> list[list[int]]:
    """The kernel's blocks of a packed step, as four lists (slot, first token index, tokens, first
    position): row ``r`` adds ``lens[r]`` tokens at positions ``start[r]..`` of slot ``slots[r]``, its
    tokens following the earlier rows' in the packed layout."""
    slot_of, tok_of, n_of, pos_of = [], [], [], []
    offset = 0
    for slot, n, s in zip(slots, lens, start, strict=True):
        for c in range(0, n, BLOCK_M):
            slot_of.append(slot)
            tok_of.append(offset + c)
            n_of.append(min(BLOCK_M, n - c))
            pos_of.append(s + c)
        offset += n
    return [slot_of, tok_of, n_of, pos_of]


def _extend_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: torch.Tensor, scale: float
) -> torch.Tensor:
    """What the kernel computes, block by block in torch (CPU, and the tests' reference)."""
    t, heads, d = q.shape
    group = heads // k_cache.shape[1]
    o = torch.empty(t, heads, d, dtype=q.dtype, device=q.device)
    for slot, tok0, n, pos0 in meta.t().tolist():
        if n == 0:
            continue
        keys = torch.arange(pos0 + n, device=q.device)
        mask = keys[None, :] <= torch.arange(pos0, pos0 + n, device=q.device)[:, None]  # [n, keys]
        kk = k_cache[slot, :, : pos0 + n].repeat_interleave(group, 0)  # [heads, keys, d]
        vv = v_cache[slot, :, : pos0 + n].repeat_interleave(group, 0)
        qq = q[tok0 : tok0 + n].transpose(0, 1)  # [heads, n, d]
        out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
        o[tok0 : tok0 + n] = out.transpose(0, 1)
    return o.view(t, heads * d)


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of packed prefill queries over their rows' cached keys.

    ``q`` [tokens, heads, d]; ``k_cache``/``v_cache`` [slots, kv_heads, positions, d] of one layer, holding
    this step's keys already; ``meta`` integer [4, blocks] from :func:`block_table` (a view of a wider
    buffer will do: graph replays pass one, padded with empty blocks). Returns
    [tokens, heads * d] in ``q``'s dtype."""
    t, heads, d = q.shape
    kv = k_cache.shape[1]
    if not q.is_cuda or triton is None:
        return _extend_reference(q, k_cache, v_cache, meta, scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    o = torch.empty(t, heads, d, dtype=q.dtype, device=q.device)
    n_blocks = meta.shape[1]
    if t and n_blocks:
        _extend_kernel[(n_blocks, heads)](
            q,
            k_cache,
            v_cache,
            o,
            meta,
            meta.stride(0),
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            o.stride(0),
            o.stride(1),
            scale * 1.4426950408889634,  # log2(e): the softmax in exp2
            G=heads // kv,
            D=d,
            BM=BLOCK_M,
            BN=BLOCK_N,
            IEEE=q.dtype == torch.float32,
            num_warps=4,
            num_stages=2,
        )
    return o.view(t, heads * d)


__all__ = ["BLOCK_M", "BLOCK_N", "available", "block_table", "extend_attention"]
