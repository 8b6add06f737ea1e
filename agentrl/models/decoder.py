"""One decoder layer, written once: the Llama / Qwen2 / Qwen3 / Qwen3-MoE block that the embedded engine
serves and that the trainer's true on-policy forward runs.

A layer's tensors travel as a :class:`LayerWeights` record: named fields, each projection separate (Hugging
Face's layout) or fused (megatron-core's ``linear_qkv`` and ``linear_fc1``), the MLP dense or a mixture of
experts (:class:`Experts`). Its math is three functions, each an exact order of ops:

* :func:`pre_attention` -- input norm, q/k/v projections, (Qwen3) q/k norms, RoPE;
* :func:`post_attention` -- output projection + residual, then the SwiGLU MLP or the mixture-of-experts
  MLP + residual (and the experts each token was routed to);
* :func:`lm_head` -- final norm and fp32 logits.

Attention sits between the first two and stays the caller's (the engine reads a slot KV cache, the trainer
a whole sequence). The functions run over a table of ops, :class:`DecoderOps`, and the table is what a
mode changes, never the order:

* :data:`TORCH_OPS` -- plain torch: the engine's default forward (torch.compile fuses it on a GPU);
* :data:`BATCH_INVARIANT_OPS` -- the kernels of :mod:`agentrl.batch_invariant`, which pick row-padded
  BLAS on a CPU or Triton on a GPU by the tensors' device: the engine's batch-invariant mode and the
  trainer's true on-policy forward, which thereby compute a token's logprob in the same order, bit for bit;
* ``agentrl.embedded.fp8.FP8_OPS`` -- the engine's fp8 rollout: projections as fp8 records;
* any of these with ``linear`` :func:`agentrl.models.lora.lora_linear` -- the engine's unmerged LoRA:
  projections as records of the weight (or its fp8 record) and an adapter beside it.

The layer lives in :mod:`agentrl.models`, beside :mod:`agentrl.models.moe`, because the engine and the
trainer both run it: here neither imports the other. The mixture-of-experts MLP (router, experts run
grouped) lives here too, as the MLP of a Qwen3-MoE layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from agentrl import batch_invariant as bi

if TYPE_CHECKING:
    from agentrl.models.moe import MoESpec

Tensor = torch.Tensor


# ---- the record -----------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Experts:
    """A mixture-of-experts MLP in transformers' fused layout (``Qwen3MoeSparseMoeBlock``): the router
    ``[E, hidden]``, every expert's ``gate_up`` ``[E, 2I, hidden]`` (gate rows, then up rows) and ``down``
    ``[E, hidden, I]``, and the routing rule: the top ``topk`` of the router's fp32 softmax, renormalized
    when ``norm_topk_prob``. ``gate_up`` and ``down`` may be weights of an experts kernel's own kind (the
    fp8 records of :mod:`agentrl.embedded.fp8`, indexed by expert like a tensor); the router stays a
    tensor."""

    router: Tensor
    gate_up: Tensor
    down: Tensor
    topk: int
    norm_topk_prob: bool


# the projections of a layer (LayerWeights' field names): what fp8 quantizes and unmerged LoRA adapts
PROJECTION_FIELDS = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")


@dataclass(frozen=True, eq=False, kw_only=True)
class LayerWeights:
    """One decoder layer's tensors, by name. They are the model's own parameters (no copies), so weights
    updated in place reach the next forward. Biases and q/k norms are None where the model has none.

    Attention: ``q``/``k``/``v`` separate, or ``qkv`` fused in megatron-core's layout (per key head: its
    query heads, its key, its value). The MLP: ``gate``/``up`` separate, or ``gate_up`` fused ([gate; up]),
    then ``down``; or, for a mixture-of-experts layer, ``experts`` alone. A fused projection gives every
    column the bits of the separate one under :data:`BATCH_INVARIANT_OPS` (a column's dot product does not
    depend on the weight's other rows)."""

    input_norm: Tensor
    q: Tensor | None = None
    q_bias: Tensor | None = None
    k: Tensor | None = None
    k_bias: Tensor | None = None
    v: Tensor | None = None
    v_bias: Tensor | None = None
    qkv: Tensor | None = None
    qkv_bias: Tensor | None = None
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    o: Tensor
    o_bias: Tensor | None = None
    mlp_norm: Tensor  # HF's post_attention_layernorm, megatron's pre_mlp_layernorm
    gate: Tensor | None = None
    gate_bias: Tensor | None = None
    up: Tensor | None = None
    up_bias: Tensor | None = None
    gate_up: Tensor | None = None
    down: Tensor | None = None
    down_bias: Tensor | None = None
    experts: Experts | None = None

    def __post_init__(self) -> None:
        if _given(self.q, self.k, self.v) != [self.qkv is None] * 3:
            raise ValueError("LayerWeights: give q, k and v, or qkv fused")
        if self.experts is not None:
            mlp = not any(_given(self.gate, self.up, self.gate_up, self.down))
        else:
            mlp = _given(self.gate, self.up) == [self.gate_up is None] * 2 and self.down is not None
        if not mlp:
            raise ValueError("LayerWeights: give gate and up, or gate_up fused, and down; or experts alone")
        if _given(self.q_norm) != _given(self.k_norm):
            raise ValueError("LayerWeights: q_norm and k_norm come together")

    @classmethod
    def of_hf_layer(cls, layer: torch.nn.Module, moe: MoESpec | None = None) -> LayerWeights:
        """The tensors of one Hugging Face decoder layer (``self_attn``, ``mlp`` and the two norms), the
        module's own parameters, so in-place weight updates reach them; a mixture-of-experts MLP
        (``moe``) as transformers' fused experts."""
        a, m = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        attention = dict(
            input_norm=layer.input_layernorm.weight,
            q=a.q_proj.weight,
            q_bias=a.q_proj.bias,
            k=a.k_proj.weight,
            k_bias=a.k_proj.bias,
            v=a.v_proj.weight,
            v_bias=a.v_proj.bias,
            q_norm=None if q_norm is None else q_norm.weight,
            k_norm=None if k_norm is None else k_norm.weight,
            o=a.o_proj.weight,
            o_bias=a.o_proj.bias,
            mlp_norm=layer.post_attention_layernorm.weight,
        )
        if moe is not None:
            experts = Experts(
                m.gate.weight, m.experts.gate_up_proj, m.experts.down_proj, moe.topk, moe.norm_topk_prob
            )
            return cls(**attention, experts=experts)
        return cls(
            **attention,
            gate=m.gate_proj.weight,
            gate_bias=m.gate_proj.bias,
            up=m.up_proj.weight,
            up_bias=m.up_proj.bias,
            down=m.down_proj.weight,
            down_bias=m.down_proj.bias,
        )


def _given(*tensors: Tensor | None) -> list[bool]:
    return [t is not None for t in tensors]


# ---- the mixture-of-experts MLP -------------------------------------------------------------------
ExpertsKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
# a grouped product mm(x [rows, in], w [E, out, in], offs [E] int32) -> [rows, out]: the rows of group g
# (offs[g - 1] to offs[g], from 0 for g = 0) times w[g].T
GroupedMM = Callable[[Tensor, Tensor, Tensor], Tensor]


def route(h: Tensor, router_weight: Tensor, topk: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """``(gates [N, k] in h's dtype, expert ids [N, k])`` for the rows of ``h`` [N, H], as transformers'
    Qwen3-MoE block routes: a softmax over the router logits in fp32, the top k, renormalized when
    ``norm_topk_prob``, cast to the model's dtype."""
    logits = F.linear(h, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    gates, ids = torch.topk(probs, topk, dim=-1)
    if norm_topk_prob:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates.to(h.dtype), ids


def experts_grouped(
    h: Tensor,
    gates: Tensor,
    ids: Tensor,
    gate_up: Tensor,
    down: Tensor,
    linear: Callable[..., Tensor] = F.linear,
) -> Tensor:
    """Σ_k gate_k · expert_{ids_k}(h) per row, one matmul per expert over the rows routed to it (eager;
    CPU and GPU without graphs): the rows of each expert gathered, run through it, weighted by their
    gate and added back. Work is k/E of running every expert on every row, and a row's result depends
    only on its own row, so a batch gives each row what it would get alone. ``linear(x, w)`` is each
    product ``x @ w.T`` (``w`` one expert's ``gate_up[e]`` or ``down[e]``)."""
    out = torch.zeros_like(h)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    k = ids.shape[1]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        rows = pairs // k
        x = h.index_select(0, rows)
        g, u = linear(x, gate_up[e]).chunk(2, dim=-1)
        y = linear(F.silu(g) * u, down[e]) * gates.reshape(-1)[pairs, None]
        out.index_add_(0, rows, y)
    return out


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """The rows of each group times its expert's weight transposed: ``torch._grouped_mm`` (see
    :data:`GroupedMM`)."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


def experts_sorted(
    h: Tensor, gates: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, mm: GroupedMM = grouped_mm
) -> Tensor:
    """:func:`experts_grouped` without host syncs (CUDA graphs): grouped GEMMs (``mm``, by default
    ``torch._grouped_mm``) over the (row, slot) pairs sorted by expert, group offsets from a cumulative
    count."""
    k = ids.shape[1]
    num_experts = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = order // k
    counts = torch.zeros(num_experts, dtype=torch.int32, device=h.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    x = h.index_select(0, rows)
    g, u = mm(x, gate_up, offs).chunk(2, dim=-1)
    y = mm(F.silu(g) * u, down, offs)
    y = y * gates.reshape(-1)[order, None]
    return torch.zeros_like(h).index_add_(0, rows, y.to(h.dtype))


def moe_mlp(h: Tensor, experts: Experts, kernel: ExpertsKernel = experts_grouped) -> tuple[Tensor, Tensor]:
    """The mixture-of-experts MLP of ``h`` [..., H]: ``(output [..., H], expert ids [..., k] int32)``."""
    lead = h.shape[:-1]
    x = h.reshape(-1, h.shape[-1])
    gates, ids = route(x, experts.router, experts.topk, experts.norm_topk_prob)
    out = kernel(x, gates, ids, experts.gate_up, experts.down)
    return out.view(*lead, -1), ids.to(torch.int32).view(*lead, experts.topk)


# ---- the ops --------------------------------------------------------------------------------------
def torch_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None
) -> Tensor:
    """``residual + (x @ weight.T + bias)`` in torch ops (the bias fused into the product by BLAS)."""
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


@dataclass(frozen=True)
class DecoderOps:
    """The kernels a decoder layer runs on. ``linear(x, weight, bias=None, residual=None)`` is
    ``residual + (x @ weight.T + bias)``; ``rms_norm(x, weight, eps)``, ``rope(x, cos, sin)`` (``x``
    [..., heads, d], tables without the head dim) and ``silu_mul(g, u)`` as in
    :mod:`agentrl.batch_invariant`; ``experts`` runs a mixture-of-experts MLP's experts (None: these
    ops serve dense layers only). A ``linear`` may take weights of its own kind in a layer's projection
    fields, and ``experts`` in the experts' ``gate_up`` and ``down``: the fp8 records of
    :mod:`agentrl.embedded.fp8` (its ``FP8_OPS``), the LM head and the router staying tensors; and the
    unmerged LoRA records of :mod:`agentrl.models.lora` around either (``linear`` its ``lora_linear``)."""

    linear: Callable[..., Tensor]
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    rope: Callable[[Tensor, Tensor, Tensor], Tensor]
    silu_mul: Callable[[Tensor, Tensor], Tensor]
    experts: ExpertsKernel | None = None


TORCH_OPS = DecoderOps(
    linear=torch_linear,
    rms_norm=bi.torch_rms_norm,
    rope=bi.torch_rope,
    silu_mul=bi.torch_silu_mul,
    experts=experts_grouped,
)
BATCH_INVARIANT_OPS = DecoderOps(linear=bi.linear, rms_norm=bi.rms_norm, rope=bi.rope, silu_mul=bi.silu_mul)


# ---- the layer ------------------------------------------------------------------------------------
def pre_attention(
    x: Tensor,
    w: LayerWeights,
    cos: Tensor,
    sin: Tensor,
    eps: float,
    heads: int,
    kv: int,
    d: int,
    ops: DecoderOps = TORCH_OPS,
) -> tuple[Tensor, Tensor, Tensor]:
    """Input norm, q/k/v projections, (Qwen3) q/k norms and RoPE: ``(q, k, v)`` of ``x`` [..., hidden],
    the heads in dim -2 (``heads`` query heads, ``kv`` key/value heads, of size ``d``)."""
    h = ops.rms_norm(x, w.input_norm, eps)
    lead = h.shape[:-1]
    if w.qkv is not None:
        qkv = ops.linear(h, w.qkv, w.qkv_bias).view(*lead, kv, heads // kv + 2, d)
        q = qkv[..., :-2, :].reshape(*lead, heads, d)
        k, v = qkv[..., -2, :], qkv[..., -1, :]
    else:
        q = ops.linear(h, w.q, w.q_bias).view(*lead, heads, d)
        k = ops.linear(h, w.k, w.k_bias).view(*lead, kv, d)
        v = ops.linear(h, w.v, w.v_bias).view(*lead, kv, d)
    if w.q_norm is not None:
        q, k = ops.rms_norm(q, w.q_norm, eps), ops.rms_norm(k, w.k_norm, eps)
    return ops.rope(q, cos, sin), ops.rope(k, cos, sin), v


def post_attention(
    x: Tensor, o: Tensor, w: LayerWeights, eps: float, ops: DecoderOps = TORCH_OPS
) -> tuple[Tensor, Tensor | None]:
    """Output projection + residual, then the MLP + residual, of the residual stream ``x`` and the
    attention output ``o`` [..., heads * d]. Returns the new residual stream and, for a mixture-of-experts
    layer, the experts each token was routed to, int32 [..., k] (None for a dense one)."""
    x = ops.linear(o, w.o, w.o_bias, residual=x)
    h = ops.rms_norm(x, w.mlp_norm, eps)
    if w.experts is not None:
        if ops.experts is None:
            raise ValueError("these decoder ops serve dense layers only, not mixture-of-experts layers")
        y, routed = moe_mlp(h, w.experts, ops.experts)
        return x + y, routed
    if w.gate_up is not None:
        gu = ops.linear(h, w.gate_up)
        n = gu.shape[-1] // 2
        act = ops.silu_mul(gu[..., :n], gu[..., n:])
    else:
        act = ops.silu_mul(ops.linear(h, w.gate, w.gate_bias), ops.linear(h, w.up, w.up_bias))
    return ops.linear(act, w.down, w.down_bias, residual=x), None


def lm_head(x: Tensor, norm: Tensor, eps: float, weight: Tensor, ops: DecoderOps = TORCH_OPS) -> Tensor:
    """fp32 logits of the final hidden states ``x``: the final norm, then the output projection."""
    return ops.linear(ops.rms_norm(x, norm, eps), weight).float()


__all__ = [
    "BATCH_INVARIANT_OPS",
    "TORCH_OPS",
    "DecoderOps",
    "Experts",
    "LayerWeights",
    "experts_grouped",
    "experts_sorted",
    "grouped_mm",
    "lm_head",
    "moe_mlp",
    "post_attention",
    "pre_attention",
    "route",
    "torch_linear",
]
