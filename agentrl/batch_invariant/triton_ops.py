"""The batch-invariant ops on a GPU, as Triton kernels whose reduction order never depends on the batch.

* ``matmul``: each program computes one output tile with a K loop from 0 to K into one fp32
  accumulator; no split-K. On an H100 ``tl.dot`` adds a K step's products into an output element in
  the same order whatever the tile's height, width or K step (bench/batch_invariant_matmul.py), so a
  row's bits depend on neither the row count, the row's position nor the tiling. The tiling is therefore
  chosen by the row count and the weight's shape for speed (narrow tiles and long K steps for a decode
  step's few rows, wide tiles for a trainer's thousands), once the premise is checked on the device:
  :func:`tilings_agree` runs every tiling on one product and compares the bits; where they differ,
  every call takes one tiling. The epilogue adds a bias and a residual as torch would after the
  product (the product rounded to the output dtype, then each sum rounded), so fusing them changes no bit.
* ``rms_norm`` and ``logsumexp``: one program per row, the row reduced in fixed-size blocks in order.
* ``rope`` and ``silu_mul``: element-wise, one kernel each instead of torch's five and two; RoPE rounds
  each product and the sum to the input dtype as torch does (in bf16 by integer ops, which no compiler
  pass fuses into one rounding).
* ``attention``: :mod:`agentrl.batch_invariant.triton_attention`.

Each op is an autograd function whose backward is plain torch: only the forward must
match the engine bit for bit.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

Tensor = torch.Tensor
log = logging.getLogger(__name__)

Tiling = tuple[int, int, int, int, int]  # BM, BN, BK, warps, stages
# the tilings :func:`tiling_for` picks from (measured on the projections of the Qwen2.5-0.5B shape and its
# LM head at 64 to 4,096 rows by bench/batch_invariant_matmul.py, with each layer's weights read from HBM)
WIDE: Tiling = (128, 128, 64, 8, 3)
SQUARE: Tiling = (64, 64, 64, 4, 3)
NARROW: Tiling = (64, 32, 128, 4, 3)
NARROW_LONG_K: Tiling = (64, 32, 256, 4, 3)
THIN_LONG_K: Tiling = (64, 16, 256, 4, 3)
TILINGS: tuple[Tiling, ...] = (WIDE, SQUARE, NARROW, NARROW_LONG_K, THIN_LONG_K)
FIXED_TILING: Tiling = SQUARE  # every call's, on a device where the tilings' bits differ


def _pick(m: int, n: int, k: int) -> Tiling:
    """The fastest measured tiling for an ``m``-row product with a weight [n, k]: a trainer's micro-batch
    takes wide tiles; a decode step's few rows take narrow ones, so that a narrow projection still spreads
    over the SMs, and long K steps where K is long (fewer steps of the serial K loop)."""
    if m > 512:
        return WIDE
    if n >= 16384:  # an LM head: programs to spare
        return SQUARE if m <= 64 else WIDE
    if k >= 2048:  # a down projection
        return NARROW_LONG_K if m <= 256 else NARROW
    if n >= 2048:  # gate / up
        return NARROW if m <= 128 else SQUARE if m <= 256 else WIDE
    return THIN_LONG_K if m <= 128 else NARROW_LONG_K if m <= 256 else NARROW


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    res_ptr,
    M,
    N,
    K,
    sam,
    sbn,
    scm,
    srm,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
    BIAS: tl.constexpr,
    RES: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * sam + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
        )
        b = tl.load(
            b_ptr + rn[None, :] * sbn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0
        )
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out = c_ptr.dtype.element_ty
    c = acc.to(out)
    if BIAS:  # torch's ``y + bias``: the rounded product plus the bias, rounded
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
        c = (c.to(tl.float32) + bias.to(tl.float32)[None, :]).to(out)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if RES:  # then ``residual + y``, rounded
        r = tl.load(res_ptr + rm[:, None] * srm + rn[None, :], mask=mask, other=0.0)
        c = (r.to(tl.float32) + c.to(tl.float32)).to(out)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :], c, mask=mask)


def _launch(a: Tensor, w: Tensor, bias: Tensor | None, res: Tensor | None, tiling: Tiling) -> Tensor:
    m, k = a.shape
    n = w.shape[0]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0:
        return c
    bm, bn, bk, warps, stages = tiling
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _mm_kernel[grid](
        a,
        w,
        c,
        c if bias is None else bias,
        c if res is None else res,
        m,
        n,
        k,
        a.stride(0),
        w.stride(0),
        c.stride(0),
        0 if res is None else res.stride(0),
        BM=bm,
        BN=bn,
        BK=bk,
        IEEE=a.dtype == torch.float32,
        BIAS=bias is not None,
        RES=res is not None,
        num_warps=warps,
        num_stages=stages,
    )
    return c


@functools.cache
def tilings_agree(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether every tiling of :data:`TILINGS` gives the same bits on ``device`` in ``dtype`` (one product of
    random operands, K not a multiple of the K step). Checked once per (device, dtype), outside any graph
    capture (the engine's runner and the trainer run a step eagerly first)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(300, 1000, device=device, dtype=dtype, generator=g)
    w = torch.randn(200, 1000, device=device, dtype=dtype, generator=g) / 32
    first, *rest = (_launch(a, w, None, None, t) for t in TILINGS)
    agree = all(torch.equal(first, other) for other in rest)
    if not agree:
        log.warning(
            "batch-invariant matmul: tilings give different bits on %s (%s); every call takes %s",
            device,
            dtype,
            FIXED_TILING,
        )
    return agree


def tiling_for(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype) -> Tiling:
    """The tiling of an ``m``-row product with a weight [n, k] (:data:`FIXED_TILING` where the tilings'
    bits differ)."""
    if not tilings_agree(device, dtype):
        return FIXED_TILING
    return _pick(m, n, k)


def _mm(a: Tensor, w: Tensor, bias: Tensor | None = None, res: Tensor | None = None) -> Tensor:
    """``res + (a [M, K] @ w[N, K].T + bias)`` in ``a``'s dtype with fp32 accumulation."""
    a, w = a.contiguous(), w.contiguous()
    if res is not None:
        res = res.contiguous()
    return _launch(a, w, bias, res, tiling_for(a.shape[0], w.shape[0], a.shape[1], a.device, a.dtype))


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, w: Tensor, bias: Tensor | None, res: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, w)
        ctx.has_bias = bias is not None
        return _mm(a, w, bias, res)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        a, w = ctx.saved_tensors
        ga = g @ w if ctx.needs_input_grad[0] else None
        gw = g.t() @ a if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        gr = g if ctx.needs_input_grad[3] else None
        return ga, gw, gb, gr


def matmul(a: Tensor, w: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """``residual + (a [M, K] @ w [N, K].T + bias)``, batch-invariant (see the module docstring); ``bias``
    [N] and ``residual`` [M, N] optional, each added as torch adds them after a product."""
    return _Matmul.apply(a, w, bias, residual)


@triton.jit
def _bf16_rounded(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), kept in fp32. Integer ops: the compiler
    would otherwise fuse a bf16 product into the add after it (one rounding where torch makes two)."""
    b = x.to(tl.uint32, bitcast=True)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    H,
    P,
    sx_t,
    sx_h,
    sc_t,
    sy_t,
    sy_h,
    HP: tl.constexpr,
    HALF: tl.constexpr,
    BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)
    j = tl.arange(0, HALF)
    mask = (h < H)[:, None]
    xp = x_ptr + t * sx_t + h[:, None] * sx_h + j[None, :]
    x1 = tl.load(xp, mask=mask, other=0.0)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0)
    out = x1.dtype
    cp = cos_ptr + (t % P) * sc_t  # the tables repeat every P tokens
    sp = sin_ptr + (t % P) * sc_t
    c1 = tl.load(cp + j).to(tl.float32)[None, :]
    c2 = tl.load(cp + HALF + j).to(tl.float32)[None, :]
    s1 = tl.load(sp + j).to(tl.float32)[None, :]
    s2 = tl.load(sp + HALF + j).to(tl.float32)[None, :]
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each product and the sum rounded
    if BF16:
        y1 = (_bf16_rounded(x1 * c1) + _bf16_rounded(-x2 * s1)).to(out)
        y2 = (_bf16_rounded(x2 * c2) + _bf16_rounded(x1 * s2)).to(out)
    else:
        y1 = ((x1 * c1).to(out).to(tl.float32) + (-x2 * s1).to(out).to(tl.float32)).to(out)
        y2 = ((x2 * c2).to(out).to(tl.float32) + (x1 * s2).to(out).to(tl.float32)).to(out)
    yp = y_ptr + t * sy_t + h[:, None] * sy_h + j[None, :]
    tl.store(yp, y1, mask=mask)
    tl.store(yp + HALF, y2, mask=mask)


def _rope_tables(lead: list[int], d: int, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin as [P, d] rows that token ``t`` (of the flattened ``lead``) reads at ``t % P``: the tables as
    they are where they span the trailing dims of ``lead`` (a trainer's [s, d] for [b, s] tokens),
    else expanded to one row per token."""
    span = list(cos.shape[:-1])
    while span and span[0] == 1:
        span.pop(0)
    if cos.shape == sin.shape and (not span or lead[len(lead) - len(span) :] == span):
        return cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
    t = math.prod(lead)
    return cos.expand(*lead, d).reshape(t, d).contiguous(), sin.expand(*lead, d).reshape(t, d).contiguous()


def _rope_forward(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    *lead, h, d = x.shape
    x3 = x.reshape(-1, h, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    t = x3.shape[0]
    c, s = _rope_tables(lead, d, cos, sin)
    y = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t:
        _rope_kernel[(t,)](
            x3,
            c,
            s,
            y,
            h,
            c.shape[0],
            x3.stride(0),
            x3.stride(1),
            c.stride(0),
            y.stride(0),
            y.stride(1),
            HP=max(2, triton.next_power_of_2(h)),
            HALF=d // 2,
            BF16=x.dtype == torch.bfloat16,
            num_warps=1,
        )
    return y.view(x.shape)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rope_forward(x, cos, sin)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rope_forward(g, cos, -sin), None, None  # the transpose of a rotation: the opposite angle


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE of ``x`` [..., heads, d] with tables ``cos``/``sin`` that broadcast to [..., d] (no head dim)."""
    return _Rope.apply(x, cos, sin)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, N, sg, su, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    g = tl.load(g_ptr + row * sg + i, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * su + i, mask=mask, other=0.0)
    out = g.dtype
    g = g.to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out)  # torch's silu(g), rounded, then times u, rounded
    tl.store(y_ptr + row * N + i, (s.to(tl.float32) * u.to(tl.float32)).to(out), mask=mask)


def _rows(x: Tensor) -> Tensor:
    """``x`` as [rows, last dim] with unit stride along the last dim (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(g, u)
        g2, u2 = _rows(g), _rows(u)  # rows may be strided: gate and up as halves of one projection
        rows, n = g2.shape
        y = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        if rows and n:
            _silu_mul_kernel[(rows, triton.cdiv(n, 1024))](
                g2, u2, y, n, g2.stride(0), u2.stride(0), BLOCK=1024, num_warps=4
            )
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        g, u = ctx.saved_tensors
        with torch.enable_grad():
            gr, ur = g.detach().requires_grad_(), u.detach().requires_grad_()
            return torch.autograd.grad(F.silu(gr) * ur, (gr, ur), grad)


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    """``silu(g) * u`` (SwiGLU's gate), element-wise."""
    return _SiluMul.apply(g, u)


@triton.jit
def _rms_kernel(x_ptr, w_ptr, y_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    y = (x * (1.0 / tl.sqrt(var + eps))).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(
        y_ptr + row * N + cols, (w.to(tl.float32) * y.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask
    )


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
            _rms_kernel[(x2.shape[0],)](
                x2, w.contiguous(), y, n, eps, BLOCK=triton.next_power_of_2(n), num_warps=4
            )
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


__all__ = [
    "TILINGS",
    "logsumexp",
    "matmul",
    "rms_norm",
    "rope",
    "silu_mul",
    "tiling_for",
    "tilings_agree",
]
