"""The trainer's core attention: torch ``scaled_dot_product_attention`` in megatron-core's local layer
spec, for padded batches (causal) and for packed sequences (causal within each sequence).

:class:`SDPACoreAttention` has the constructor and call signature of megatron's ``DotProductAttention``;
it runs on CPU and takes the flash / memory-efficient kernels on a GPU. Packed input (a micro-batch's
sequences end to end, with their bounds in ``packed_seq_params``) goes through
:func:`packed_causal_attention`: torch's variable-length flash kernel on a GPU in bf16/fp16, one SDPA per
sequence elsewhere.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SDPACoreAttention", "packed_causal_attention"]


class SDPACoreAttention(torch.nn.Module):
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention``: causal, GQA.

    Same constructor keywords and call signature as megatron's ``DotProductAttention`` (its
    ``CoreAttention`` protocol): q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]`` -> ``[sq, b, np*hn]``.
    Sequences are right-padded, so causal masking alone keeps real tokens from seeing padding.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **_: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        **_: Any,  # keywords newer megatron-core versions may add
    ) -> torch.Tensor:
        if packed_seq_params is not None:  # packed sequences: q [t, 1, np, hn], k/v [t, 1, ng, hn]
            out = packed_causal_attention(
                query.squeeze(1),
                key.squeeze(1),
                value.squeeze(1),
                packed_seq_params.cu_seqlens_q,
                packed_seq_params.max_seqlen_q,
                self.softmax_scale,
            )
            return out.reshape(query.shape[0], 1, -1)
        sq, b, nh, hd = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        gqa = k.shape[1] != nh
        if gqa and not q.is_cuda:  # CPU: repeated KV heads (the numerics the CPU figures were taken with)
            k = k.repeat_interleave(nh // k.shape[1], dim=1)
            v = v.repeat_interleave(nh // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=gqa and q.is_cuda,  # GPU kernels read each KV head for its query group: no copies
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, nh * hd)


def _varlen_attn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each document of a packed sequence: q ``[t, heads, d]``, k/v ``[t, kv_heads,
    d]``, documents ``[cu_seqlens[i], cu_seqlens[i+1])``; returns ``[t, heads, d]``. On a GPU in bf16/fp16
    torch's variable-length flash kernel runs all documents at once; elsewhere (CPU, fp32) one SDPA per
    document."""
    gqa = k.shape[1] != q.shape[1]
    varlen = _varlen_attn()
    if varlen is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        import inspect

        causal = (
            {"is_causal": True}
            if "is_causal" in inspect.signature(varlen).parameters
            else {"window_size": (-1, 0)}
        )
        if gqa:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        cu = cu_seqlens.to(torch.int32)
        return varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, **causal)
    outs = []
    for a, b in itertools.pairwise(cu_seqlens.tolist()):
        qd, kd, vd = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, d]
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs)
