"""Mixture-of-experts MLPs in the embedded engine: the router's top-k, the experts computed grouped, and
which experts each token went to (the routing the engine reports for replay in the trainer).

The weights are the HF module's own parameters (``Qwen3MoeSparseMoeBlock``: ``gate.weight`` [E, H],
``experts.gate_up_proj`` [E, 2I, H] (gate rows then up rows), ``experts.down_proj`` [E, H, I]), so weight
updates copied into the module reach the forward with no copy. Routing follows the HF module: a softmax
over the router logits in fp32, the top-k, renormalized when ``norm_topk_prob``, cast to the model's dtype.

Two ways to run the experts, the same math:

* :func:`experts_grouped` (eager; CPU and GPU without graphs): the tokens routed to each expert are
  gathered (``index_select``), run through that expert as one matmul each, weighted by their gate and
  added back (``index_add_``). Work is k/E of running every expert on every token, and a token's result
  depends only on its own row, so a batch gives each row what it would get alone.
* :func:`experts_sorted` (CUDA graphs): the (token, slot) pairs are sorted by expert and run with
  ``torch._grouped_mm`` over fixed-size buffers, with no host sync, so a decode step can be captured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    h: torch.Tensor, router_weight: torch.Tensor, topk: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gates [N, k] in h's dtype, expert ids [N, k])`` for the rows of ``h`` [N, H]."""
    logits = F.linear(h, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    gates, ids = torch.topk(probs, topk, dim=-1)
    if norm_topk_prob:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates.to(h.dtype), ids


def experts_grouped(
    h: torch.Tensor, gates: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Σ_k gate_k · expert_{ids_k}(h) per row, one matmul per expert over the rows routed to it."""
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
        g, u = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * gates.reshape(-1)[pairs, None]
        out.index_add_(0, rows, y)
    return out


def experts_sorted(
    h: torch.Tensor, gates: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """:func:`experts_grouped` without host syncs (CUDA graphs): ``torch._grouped_mm`` over the (row,
    slot) pairs sorted by expert, group offsets from a cumulative count."""
    k = ids.shape[1]
    num_experts = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = order // k
    counts = torch.zeros(num_experts, dtype=torch.int32, device=h.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    x = h.index_select(0, rows)
    gu = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offs)
    y = y * gates.reshape(-1)[order, None]
    return torch.zeros_like(h).index_add_(0, rows, y.to(h.dtype))


def moe_mlp(
    h: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk: int,
    norm_topk_prob: bool,
    sorted_experts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE MLP of ``h`` [..., H]: ``(output [..., H], expert ids [..., k] int32)``."""
    lead = h.shape[:-1]
    x = h.reshape(-1, h.shape[-1])
    gates, ids = route(x, router_weight, topk, norm_topk_prob)
    run = experts_sorted if sorted_experts else experts_grouped
    out = run(x, gates, ids, gate_up, down)
    return out.view(*lead, -1), ids.to(torch.int32).view(*lead, topk)


def fused_expert_name(name: str, num_experts: int) -> tuple[str, int, str] | None:
    """An HF checkpoint's per-expert tensor name (``...mlp.experts.{e}.{gate|up|down}_proj.weight``) ->
    ``(fused parameter name, expert, part)`` of transformers' fused experts (``...mlp.experts.gate_up_proj``
    / ``down_proj``); None for any other name."""
    head, sep, tail = name.partition(".mlp.experts.")
    if not sep:
        return None
    parts = tail.split(".")
    if len(parts) != 3 or not parts[0].isdigit() or parts[2] != "weight":
        return None
    e, proj = int(parts[0]), parts[1]
    if proj not in ("gate_proj", "up_proj", "down_proj") or e >= num_experts:
        return None
    fused = "gate_up_proj" if proj != "down_proj" else "down_proj"
    return f"{head}.mlp.experts.{fused}", e, proj


__all__ = ["experts_grouped", "experts_sorted", "fused_expert_name", "moe_mlp", "route"]
