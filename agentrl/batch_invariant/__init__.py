"""Batch-invariant kernels: a row's result does not depend on how many rows share the call, nor where it sits.

Nondeterminism in inference is mostly batch variance: a kernel picks another tiling, or splits a
reduction differently, when the batch changes size, so one request's logits change with its neighbours.
Every op here fixes the reduction order of a row whatever the batch:

* :func:`linear` -- on CPU the rows go through BLAS in a multiple of :data:`ROW_TILE` rows (oneDNN/MKL
  switch to other kernels below about a dozen rows; from 12 rows on, a row's dot products are the same
  bits for any row count, any row position and any output width, measured on AVX-512 and AVX2). On a
  GPU a Triton matmul with no split-K whose bits do not depend on its tiling (:mod:`.triton_ops`).
* :func:`rope`, :func:`silu_mul` -- element-wise (one fused kernel each on a GPU).
* :func:`rms_norm`, :func:`logsumexp` -- reduced within a row (one Triton program per row on a GPU).
* :func:`attention` -- every query walks its keys ``0..pos`` in chunks of :data:`KEY_CHUNK` from key 0,
  in order, whether it is one decode query over a KV cache, one of a prefill chunk, or one of a
  trainer's full sequence. Keys past ``pos`` contribute exact zeros, so the bucket a decode step pads to
  and the chunking of a prefill do not change a bit.

The decoder layer runs over these ops (:data:`agentrl.models.decoder.BATCH_INVARIANT_OPS`) in the engine's
deterministic mode and in the trainer's true on-policy forward, so both compute a token's logprob in the
same order. ``torch_rms_norm``, ``torch_rope`` and ``torch_silu_mul`` are the torch formulas the kernels
reproduce: the CPU kernels themselves, and the default forward's ops on every device.
Autograd works through every op (on a GPU the Triton forward has a torch backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

ROW_TILE = 16  # CPU: rows reach BLAS in multiples of this (invariant from 12 rows on)
KEY_CHUNK = 64  # attention reduces over keys in chunks of this many, in order
QUERY_BLOCK = 64  # CPU prefill: queries per block; a block reads only the key chunks it can see


def _rows_padded(m: int) -> int:
    return max(ROW_TILE, -(-m // ROW_TILE) * ROW_TILE)


def _pad_rows(x: Tensor, dim: int) -> tuple[Tensor, int]:
    """``x`` padded with zero rows along ``dim`` to a multiple of :data:`ROW_TILE` (contiguous)."""
    m = x.shape[dim]
    extra = _rows_padded(m) - m
    if extra:
        pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, extra]
        x = F.pad(x, pad)
    return x.contiguous(), m


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """``residual + (x @ weight.T + bias)`` with each output row independent of the other rows; the bias
    and the residual are added after the product, each sum rounded (an addmm may fuse the bias in another
    order). On a GPU both are the matmul's epilogue, with the same bits."""
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    r2 = None if residual is None else residual.reshape(-1, n)
    if x.is_cuda:
        from agentrl.batch_invariant.triton_ops import matmul

        return matmul(x2, weight, bias, r2).view(*lead, n)
    xp, m = _pad_rows(x2, 0)
    y = F.linear(xp, weight)[:m]
    if bias is not None:
        y = y + bias
    if r2 is not None:
        y = r2 + y
    return y.view(*lead, n)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim (fp32 statistics, weight applied in the input dtype), per row."""
    if x.is_cuda:
        from agentrl.batch_invariant.triton_ops import rms_norm as tri

        return tri(x, weight, eps)
    return torch_rms_norm(x, weight, eps)


def torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as the HF Llama/Qwen modules compute it, in torch ops: :func:`rms_norm` on a CPU, and the
    default (not batch-invariant) forward's norm on every device."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def logsumexp(x: Tensor) -> Tensor:
    """fp32 ``logsumexp`` of each row of ``x`` [rows, n]."""
    if x.is_cuda:
        from agentrl.batch_invariant.triton_ops import logsumexp as tri

        return tri(x)
    return torch.logsumexp(x.float(), dim=-1)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log_softmax(logits)[target]`` per row of fp32 ``logits`` [rows, vocab], the engine's and the
    true on-policy trainer's one formula."""
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logsumexp(logits)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    scale: float,
    slots: Tensor | None = None,
    deterministic_backward: bool = False,
) -> Tensor:
    """Causal attention of queries at known positions over keys ``0..pos``.

    ``q`` [B, W, H, d]: W queries of sequence ``b`` at positions ``q_pos`` [B, W] (a query sees the keys
    at positions ``<= q_pos``; clamp padding queries to 0). ``k``/``v`` [S, KV, L, d]: the keys of
    sequence ``b`` are ``k[slots[b]]`` (``k[b]`` without ``slots``), at positions ``0..L-1``; GQA by
    grouping ``H // KV`` query heads per key head. Only keys up to the largest position are read, so
    ``L`` may run past it (a whole KV cache). Returns [B, W, H * d] in ``q``'s dtype. On a GPU the
    backward (training on a sequence's own keys) is torch SDPA, with ``deterministic_backward`` its math
    kernel."""
    if q.is_cuda:
        from agentrl.batch_invariant.triton_attention import attention as tri

        return tri(q, k, v, q_pos, scale, slots, deterministic_backward)
    w = q.shape[1]
    # one host read of the positions: the last key chunk each block of queries can see
    last = q_pos.amax(0).tolist()
    keys = (max(last) // KEY_CHUNK + 1) * KEY_CHUNK
    k, v = k[:, :, :keys], v[:, :, :keys]  # slice first: gather and copy only the keys in use
    if slots is not None:
        k, v = k.index_select(0, slots), v.index_select(0, slots)
    if k.shape[2] < keys:
        pad = keys - k.shape[2]
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    if w <= QUERY_BLOCK:
        return _attend(q, k, v, q_pos, scale)
    out = []
    for s in range(0, w, QUERY_BLOCK):  # causal: a block reads the key chunks up to its own last query
        e = min(w, s + QUERY_BLOCK)
        n = (max(last[s:e]) // KEY_CHUNK + 1) * KEY_CHUNK
        out.append(_attend(q[:, s:e], k[:, :, :n], v[:, :, :n], q_pos[:, s:e], scale))
    return torch.cat(out, 1)


def _attend(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """:func:`attention` on CPU for keys ``k``/``v`` [B, KV, n * KEY_CHUNK, d], one per query row.

    A query row's bits depend on its own query and keys only: both matmuls see a multiple of
    :data:`ROW_TILE` rows; the mask is element-wise and the softmax works within the row; the weighted
    values are summed within each key chunk by the matmul, then the chunks by a running total from key
    0 (``cumsum``, one pass in order). Keys past a query's position give exact zeros to every sum, so
    reading more chunks (a longer decode bucket, a later query block) changes no bit."""
    b, w, h, d = q.shape
    kv, keys = k.shape[1], k.shape[2]
    g = h // kv
    n = keys // KEY_CHUNK
    rows = w * g  # query rows of a key head: (query, head of the group)
    padded = _rows_padded(rows)
    qg = q.new_zeros(b, kv, padded, d)
    qg[:, :, :rows].view(b, kv, w, g, d).copy_(q.view(b, w, kv, g, d).transpose(1, 2))
    s = torch.matmul(qg, k.transpose(-1, -2))[:, :, :rows].float() * scale  # [b, kv, rows, keys]
    past = torch.arange(keys, device=q.device) > q_pos[:, None, :, None, None]  # [b, 1, w, 1, keys]
    s.view(b, kv, w, g, keys).masked_fill_(past, float("-inf"))
    # torch's CPU softmax sums a row lane by lane from key 0 (a multiple of 64 keys: no scalar tail), so
    # the masked keys' zeros at the end change no lane and no bit of the sum
    p = torch.softmax(s, -1)
    pc = p.new_zeros(b, kv, n, padded, KEY_CHUNK, dtype=v.dtype)  # the chunks' rows, padded for BLAS
    pc[:, :, :, :rows] = p.view(b, kv, rows, n, KEY_CHUNK).transpose(2, 3)
    part = torch.matmul(pc, v.view(b, kv, n, KEY_CHUNK, d))[:, :, :, :rows]  # [b, kv, n, rows, d]
    o = (part.cumsum(2)[:, :, -1] if n > 1 else part[:, :, 0]).to(q.dtype)
    return o.view(b, kv, w, g, d).transpose(1, 2).reshape(b, w, h * d)


def rope_tables(inv_freq: Tensor, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [n, head_dim] of positions ``0..n-1`` from the model's ``inv_freq`` (plain RoPE), by
    element-wise products on ``device`` (no matmul, so no TF32 or tiling choice enters)."""
    pos = torch.arange(n, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` [..., heads, d] and tables that broadcast to [..., d];
    each product and the sum rounded to ``x``'s dtype (one kernel on a GPU)."""
    if x.is_cuda:
        from agentrl.batch_invariant.triton_ops import rope as tri

        return tri(x, cos, sin)
    return torch_rope(x, cos, sin)


def torch_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`rope` in torch ops (its CPU kernel; the default forward's RoPE on every device)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    """SwiGLU's ``silu(g) * u`` (one kernel on a GPU)."""
    if g.is_cuda:
        from agentrl.batch_invariant.triton_ops import silu_mul as tri

        return tri(g, u)
    return torch_silu_mul(g, u)


def torch_silu_mul(g: Tensor, u: Tensor) -> Tensor:
    """:func:`silu_mul` in torch ops (its CPU kernel; the default forward's SwiGLU on every device)."""
    return F.silu(g) * u


__all__ = [
    "KEY_CHUNK",
    "ROW_TILE",
    "attention",
    "linear",
    "logsumexp",
    "rms_norm",
    "rope",
    "rope_tables",
    "silu_mul",
    "token_logprobs",
    "torch_rms_norm",
    "torch_rope",
    "torch_silu_mul",
]
