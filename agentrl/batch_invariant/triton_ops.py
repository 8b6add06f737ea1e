"""The batch-invariant ops on a GPU, as Triton kernels with one configuration for every shape.

* ``matmul``: each program computes one [64, 64] output tile with a K loop of 64 from 0 to K; no split-K,
  no autotuning, the row count is not a specialisation key. A row's dot products are therefore the same
  instructions in the same order for any number of rows and any row position.
* ``rms_norm`` and ``logsumexp``: one program per row, the row reduced in fixed-size blocks in order.
* ``attention``: one program per (query token, key head), the group's query heads in the rows of a
  [16, d] tile; it walks keys ``0..pos`` of its sequence in blocks of :data:`KEY_CHUNK` with an online
  softmax. Decode (one query over the KV cache), a prefill chunk and a trainer's whole sequence run this
  one loop, so a query's output does not depend on which of them computed it.

Each op is an autograd function whose backward is plain torch (cuBLAS, SDPA): only the forward must
match the engine bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from agentrl.batch_invariant import KEY_CHUNK

Tensor = torch.Tensor

_BM, _BN, _BK, _WARPS, _STAGES = 64, 64, 64, 4, 3  # the one tiling, for every shape


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sbn, scm,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * sam + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rn[None, :] * sbn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :], c, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _mm(a: Tensor, w: Tensor) -> Tensor:
    """``a [M, K] @ w[N, K].T`` in ``a``'s dtype with fp32 accumulation."""
    a, w = a.contiguous(), w.contiguous()
    m, k = a.shape
    n = w.shape[0]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0:
        return c
    grid = (triton.cdiv(m, _BM), triton.cdiv(n, _BN))
    _mm_kernel[grid](a, w, c, m, n, k, a.stride(0), w.stride(0), c.stride(0),
                     BM=_BM, BN=_BN, BK=_BK, IEEE=a.dtype == torch.float32, num_warps=_WARPS, num_stages=_STAGES)  # fmt: skip
    return c


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, w: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, w)
        return _mm(a, w)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None]:  # type: ignore[override]
        a, w = ctx.saved_tensors
        ga = g @ w if ctx.needs_input_grad[0] else None
        gw = g.t() @ a if ctx.needs_input_grad[1] else None
        return ga, gw


def matmul(a: Tensor, w: Tensor) -> Tensor:
    """``a [M, K] @ w [N, K].T``, batch-invariant (see the module docstring)."""
    return _Matmul.apply(a, w)


@triton.jit
def _rms_kernel(x_ptr, w_ptr, y_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    y = (x * (1.0 / tl.sqrt(var + eps))).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * N + cols, (w.to(tl.float32) * y.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def _rms_torch(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        n = x.shape[-1]
        x2 = x.contiguous().view(-1, n)
        y = torch.empty_like(x2)
        if x2.shape[0]:
            _rms_kernel[(x2.shape[0],)](x2, w.contiguous(), y, n, eps, BLOCK=triton.next_power_of_2(n), num_warps=4)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
            gx, gw = torch.autograd.grad(_rms_torch(xr, wr, ctx.eps), (xr, wr), g)
        return gx, gw, None


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return _RMSNorm.apply(x, w, eps)


@triton.jit
def _lse_kernel(x_ptr, out_ptr, N, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    mvec = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < N, other=float("-inf")).to(tl.float32)
        mvec = tl.maximum(mvec, x)
    m = tl.max(mvec, axis=0)
    svec = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < N, other=float("-inf")).to(tl.float32)
        svec += tl.exp(x - m)
    tl.store(out_ptr + row, m + tl.log(tl.sum(svec, axis=0)))


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        x2 = x.contiguous()
        out = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        if x2.shape[0]:
            _lse_kernel[(x2.shape[0],)](x2, out, x2.shape[1], x2.stride(0), BLOCK=4096, num_warps=8)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:  # type: ignore[override]
        x, out = ctx.saved_tensors
        return (torch.exp(x.float() - out[:, None]) * g[:, None]).to(x.dtype)


def logsumexp(x: Tensor) -> Tensor:
    return _LogSumExp.apply(x)


@triton.jit(do_not_specialize=["W"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, slot_ptr, pos_ptr, W,
                 sq_t, sq_h, sk_s, sk_h, sk_l, sv_s, sv_h, sv_l, so_t, so_h, scale,
                 G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                 IEEE: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t // W).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int32)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = h * G + g
    q = tl.load(q_ptr + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=(g < G)[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    kb = k_ptr + slot * sk_s + h * sk_h
    vb = v_ptr + slot * sv_s + h * sv_h
    for start in range(0, pos + 1, BN):
        n = start + tl.arange(0, BN)
        seen = n <= pos
        k = tl.load(kb + n[:, None] * sk_l + d[None, :], mask=seen[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(seen[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vb + n[:, None] * sv_l + d[None, :], mask=seen[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + t * so_t + heads[:, None] * so_h + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=(g < G)[:, None])  # fmt: skip


def _attn_forward(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, slots: Tensor | None) -> Tensor:
    b, w, h, d = q.shape
    kv = k.shape[1]
    g = h // kv
    if d & (d - 1) or d < 16 or g > 16:
        raise ValueError(f"the GPU attention kernel needs a power-of-two head_dim >= 16 and <= 16 query heads "
                         f"per key head (got head_dim {d}, {g})")  # fmt: skip
    qt = q.reshape(b * w, h, d)
    if qt.stride(-1) != 1:
        qt = qt.contiguous()
    o = torch.empty(b * w, h, d, dtype=q.dtype, device=q.device)
    if slots is None:
        slots = torch.arange(b, device=q.device)
    pos = q_pos.reshape(-1).contiguous()
    if b * w:
        _attn_kernel[(b * w, kv)](
            qt, k, v, o, slots, pos, w,
            qt.stride(0), qt.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), scale,
            G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BN=KEY_CHUNK,
            IEEE=q.dtype == torch.float32, num_warps=4,
        )  # fmt: skip
    return o.view(b, w, h * d)


class _Attention(torch.autograd.Function):
    """Forward in the kernel; backward by torch SDPA (causal, over the sequence's own keys: the trainer's
    case, ``k``/``v`` [B, KV, W, d] with ``q_pos`` the positions 0..W-1)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, slots: Tensor | None,
                deterministic: bool) -> Tensor:  # type: ignore[override]  # fmt: skip
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
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, slots: Tensor | None = None,
    deterministic_backward: bool = False,
) -> Tensor:  # fmt: skip
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, q_pos, scale, slots, deterministic_backward)
    return _attn_forward(q, k, v, q_pos, scale, slots)


__all__ = ["attention", "logsumexp", "matmul", "rms_norm"]
