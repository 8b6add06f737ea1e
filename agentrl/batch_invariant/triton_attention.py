"""The batch-invariant attention on a GPU, as one Triton kernel whose reduction order never depends on
the batch: one program per (block of query tokens, key head), the group's query heads in the rows of a
tile (one token's, padded to 16 rows, at decode; 64 rows of several tokens' in prefill and training);
each row walks keys ``0..pos`` of its sequence in blocks of :data:`KEY_CHUNK` with an online softmax, and
keeps its state unchanged past its own last block. The row sums run on the tensor cores as the products
do (a ``tl.sum`` would add in an order set by the tile's layout). Decode (one query over the KV cache), a
prefill chunk and a trainer's whole sequence run this one loop, so a query's output does not depend on
which of them computed it.

The op is an autograd function whose backward is torch's SDPA: only the forward must match the engine
bit for bit. The other ops: :mod:`agentrl.batch_invariant.triton_ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from agentrl.batch_invariant import KEY_CHUNK

Tensor = torch.Tensor


@triton.jit(do_not_specialize=["W", "NB"])
def _attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    slot_ptr,
    pos_ptr,
    W,
    NB,
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
    scale,
    G: tl.constexpr,
    GP: tl.constexpr,
    BQ: tl.constexpr,
    D: tl.constexpr,
    BN: tl.constexpr,
    IEEE: tl.constexpr,
):
    # rows of the tile: BQ query tokens x GP heads of the key head's group (padding rows never see a key)
    blk = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = blk // NB
    r = tl.arange(0, BQ * GP)
    qi = (blk % NB) * BQ + r // GP
    g = r % GP
    valid = (qi < W) & (g < G)
    t = b * W + qi
    slot = tl.load(slot_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + t, mask=valid, other=-1).to(tl.int32)
    last = tl.max(pos, axis=0)
    d = tl.arange(0, D)
    heads = h * G + g
    q = tl.load(
        q_ptr + t[:, None] * sq_t + heads[:, None] * sq_h + d[None, :], mask=valid[:, None], other=0.0
    )
    m_i = tl.full([BQ * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ * GP], dtype=tl.float32)
    acc = tl.zeros([BQ * GP, D], dtype=tl.float32)
    kb = k_ptr + slot * sk_s + h * sk_h
    vb = v_ptr + slot * sv_s + h * sv_h
    for start in range(0, last + 1, BN):
        n = start + tl.arange(0, BN)
        k = tl.load(kb + n[:, None] * sk_l + d[None, :], mask=(n <= last)[:, None], other=0.0)
        v = tl.load(vb + n[:, None] * sv_l + d[None, :], mask=(n <= last)[:, None], other=0.0)
        ones = tl.full([BN, 16], 1.0, v.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n[None, :] <= pos[:, None], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None]).to(v.dtype)
        # the row sum by the tensor cores too: a tl.sum's order follows the tile's layout, a dot's does not
        if IEEE:
            l_new = l_i * alpha + tl.max(tl.dot(p, ones, input_precision="ieee"), axis=1)
            acc_new = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            l_new = l_i * alpha + tl.max(tl.dot(p, ones), axis=1)
            acc_new = acc * alpha[:, None] + tl.dot(p, v)
        active = start <= pos  # a row past its own last key chunk keeps its state bit for bit
        m_i = tl.where(active, m_new, m_i)
        l_i = tl.where(active, l_new, l_i)
        acc = tl.where(active[:, None], acc_new, acc)
    o = acc / l_i[:, None]
    tl.store(
        o_ptr + t[:, None] * so_t + heads[:, None] * so_h + d[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=valid[:, None],
    )


def _attn_forward(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, slots: Tensor | None
) -> Tensor:
    b, w, h, d = q.shape
    kv = k.shape[1]
    g = h // kv
    if d & (d - 1) or d < 16 or g > 16:
        raise ValueError(
            f"the GPU attention kernel needs a power-of-two head_dim >= 16 and <= 16 query heads "
            f"per key head (got head_dim {d}, {g})"
        )
    qt = q.reshape(b * w, h, d)
    if qt.stride(-1) != 1:
        qt = qt.contiguous()
    o = torch.empty(b * w, h, d, dtype=q.dtype, device=q.device)
    if slots is None:
        slots = torch.arange(b, device=q.device)
    pos = q_pos.reshape(-1).contiguous()
    # decode (one query per sequence): a tile of one token's group, padded to 16 rows; prefill and training:
    # 64 rows of several tokens' groups. A row's keys, chunks and dots are the same in both.
    gp = triton.next_power_of_2(g)
    bq = 1 if w == 1 else max(1, 64 // gp)
    gp = max(gp, 16 // bq)
    nb = triton.cdiv(w, bq)
    if b * w:
        _attn_kernel[(b * nb, kv)](
            qt,
            k,
            v,
            o,
            slots,
            pos,
            w,
            nb,
            qt.stride(0),
            qt.stride(1),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            o.stride(0),
            o.stride(1),
            scale,
            G=g,
            GP=gp,
            BQ=bq,
            D=d,
            BN=KEY_CHUNK,
            IEEE=q.dtype == torch.float32,
            num_warps=4,
        )
    return o.view(b, w, h * d)


class _Attention(torch.autograd.Function):
    """Forward in the kernel; backward by torch SDPA (causal, over the sequence's own keys: the trainer's
    case, ``k``/``v`` [B, KV, W, d] with ``q_pos`` the positions 0..W-1)."""

    @staticmethod
    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_pos: Tensor,
        scale: float,
        slots: Tensor | None,
        deterministic: bool,
    ) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.deterministic = scale, deterministic
        return _attn_forward(q, k, v, q_pos, scale, slots)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        b, w, h, d = q.shape
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # the flash / efficient backward accumulates dq over key blocks in a varying order; math does not
        fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        backends = [SDPBackend.MATH] if ctx.deterministic else [*fast, SDPBackend.MATH]
        with torch.enable_grad(), sdpa_kernel(backends):
            qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
            o = F.scaled_dot_product_attention(
                qr.transpose(1, 2), kr, vr, is_causal=True, scale=ctx.scale, enable_gqa=h != k.shape[1]
            )
            gq, gk, gv = torch.autograd.grad(o.transpose(1, 2).reshape(b, w, h * d), (qr, kr, vr), g)
        return gq, gk, gv, None, None, None, None


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    scale: float,
    slots: Tensor | None = None,
    deterministic_backward: bool = False,
) -> Tensor:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, q_pos, scale, slots, deterministic_backward)
    return _attn_forward(q, k, v, q_pos, scale, slots)


__all__ = ["attention"]
