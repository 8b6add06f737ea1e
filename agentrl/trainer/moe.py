"""Mixture-of-experts models in the trainer: megatron-core's MoE layer config, the expert weights' mapping
between HF and megatron-core (tensor- and expert-parallel), routing replay and the load-balancing loss as
a metric. Which families are served and the MoE shape of an HF config are model facts the engine shares
(:mod:`agentrl.models.moe`).

**Family.** Qwen3-MoE (``qwen3_moe``): Qwen3 attention (per-head q/k RMSNorm, no qkv bias) and in every
layer a top-k softmax router (``mlp.gate``) over ``num_experts`` SwiGLU experts
(``mlp.experts.{e}.{gate,up,down}_proj``), no shared expert. ``norm_topk_prob`` renormalizes the k gates
(megatron: top-k over the logits then a softmax over the k, ``moe_router_pre_softmax=False``); without it
the gates are the full softmax's values at the k experts (``moe_router_pre_softmax=True``). Other MoE
families (Mixtral, DeepSeek-V2/V3, Qwen2-MoE with its shared expert, GLM-4.5, ...) are refused by name.

**Megatron side.** megatron-core's ``MoELayer`` from the local spec: ``TopKRouter`` (its
``router.weight`` is the HF gate, replicated over TP), the ``allgather`` token dispatcher (the one that
runs on gloo as well as NCCL; ``alltoall`` allocates CUDA streams) and ``SequentialMLP`` experts (one
``ColumnParallelLinear``/``RowParallelLinear`` pair per local expert, the expert's ``linear_fc1`` is
``[gate_t; up_t]`` per TP rank like the dense MLP), or agentrl's grouped-GEMM experts
(:class:`~agentrl.trainer.experts.GroupedExperts`: the same weights stacked per layer as
``experts.fc1_weight`` ``[E_local, 2*ffn/tp, hidden]`` and ``experts.fc2_weight`` ``[E_local, hidden,
ffn/tp]``, run with ``torch._grouped_mm``; megatron-core's own grouped modules need Transformer Engine or
the ``grouped_gemm`` package, neither of which agentrl requires). The HF mapping below writes the
per-expert layout; :func:`expert_layout` stacks or unstacks a local state dict bit-exactly, so
converted shards and Megatron dirs load into either.

**Expert parallelism** (``ep``): rank ``e`` of the expert-parallel group holds experts
``[e*E/ep, (e+1)*E/ep)`` under local names ``local_experts.0..``; everything else is replicated over
``ep``. Converted shards are keyed ``(pp_rank, tp_rank, ep_rank)`` when ``ep > 1``.

**Routing replay (R3).** The engine reports, per token and layer, the k experts it routed to (SGLang's
``meta_info["routed_experts"]``: base64 of int32 ``[tokens, layers, k]``, every input position of the
sequence, i.e. all tokens but the last). With replay on, each router's top-k indices are forced to the
recorded ones and the gates are recomputed from this forward's router logits at those indices (so the
router still gets gradients). Rows with no record (``-1``) keep their own top-k.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from agentrl.models.moe import MoESpec, decode_routed_experts
from agentrl.trainer.batch import input_length

if TYPE_CHECKING:
    from agentrl.trainer.batch import MicroBatch
    from agentrl.types import Trajectory


def transformer_kwargs(moe: MoESpec, ep: int = 1, aux_loss_coef: float | None = None) -> dict[str, Any]:
    """The megatron ``TransformerConfig`` fields of ``moe`` (``aux_loss_coef`` None: the HF config's)."""
    coef = moe.aux_loss_coef if aux_loss_coef is None else aux_loss_coef
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if coef > 0 else "none",
        moe_aux_loss_coeff=coef,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_router_dtype="fp32",
        expert_model_parallel_size=ep,
    )


# ---- HF <-> megatron expert weights ----------------------------------------------------------------
def hf_moe_names(layer: int, num_experts: int) -> list[str]:
    """The HF tensor names of one MoE layer's MLP (router, then every expert's three projections)."""
    h = f"model.layers.{layer}.mlp."
    names = [h + "gate.weight"]
    for e in range(num_experts):
        names += [h + f"experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
    return names


def hf_moe_shapes(layer: int, moe: MoESpec, hidden: int) -> dict[str, tuple[int, ...]]:
    h, f = f"model.layers.{layer}.mlp.", moe.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {h + "gate.weight": (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        shapes |= {
            h + f"experts.{e}.gate_proj.weight": (f, hidden),
            h + f"experts.{e}.up_proj.weight": (f, hidden),
            h + f"experts.{e}.down_proj.weight": (hidden, f),
        }
    return shapes


def check_moe_tensors(hf: Mapping[str, torch.Tensor], layer: int, moe: MoESpec, hidden: int) -> None:
    """Raise ``ValueError`` naming the first tensor of layer ``layer``'s MLP that is missing or has
    another shape than ``moe`` says (an expert count or size that does not match the config). A mapping
    with a ``shape(name)`` method (:class:`~agentrl.trainer.model.LazyHFStateDict`) is checked without
    reading a tensor."""
    want = hf_moe_shapes(layer, moe, hidden)
    shape_of = getattr(hf, "shape", None)
    for name, shape in want.items():
        if name not in hf:
            raise ValueError(
                f"{name}: missing (config: {moe.num_experts} experts of size {moe.ffn_hidden_size})"
            )
        have = shape_of(name) if shape_of is not None else tuple(hf[name].shape)
        if have != shape:
            raise ValueError(f"{name}: shape {have} != {shape} from the config")
    extra = f"model.layers.{layer}.mlp.experts.{moe.num_experts}.gate_proj.weight"
    if extra in hf:
        raise ValueError(f"{extra}: more experts in the checkpoint than num_experts={moe.num_experts}")


def moe_layer_to_mcore(
    hf: Mapping[str, torch.Tensor],
    layer: int,
    moe: MoESpec,
    hidden: int,
    tp: int,
    ep: int,
    wanted: set[tuple[int, int]] | None = None,
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """One HF MoE layer's MLP -> ``{(tp_rank, ep_rank): {local megatron name under 'mlp.': tensor}}``, for
    the ``wanted`` (tp_rank, ep_rank) pairs only when given (the experts of other ranks are not read)."""
    check_moe_tensors(hf, layer, moe, hidden)
    h = f"model.layers.{layer}.mlp."
    if moe.ffn_hidden_size % tp:
        raise ValueError(f"moe_intermediate_size {moe.ffn_hidden_size} does not split over tp {tp}")
    pairs = [(t, e) for t in range(tp) for e in range(ep) if wanted is None or (t, e) in wanted]
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {pair: {} for pair in pairs}
    router = hf[h + "gate.weight"]
    for pair in pairs:
        out[pair]["router.weight"] = router
    for e in sorted({e for _, e in pairs}):
        start, end = moe.expert_range(ep, e)
        for j, g in enumerate(range(start, end)):
            x = h + f"experts.{g}."
            gate = torch.chunk(hf[x + "gate_proj.weight"], tp, dim=0)
            up = torch.chunk(hf[x + "up_proj.weight"], tp, dim=0)
            down = torch.chunk(hf[x + "down_proj.weight"], tp, dim=1)
            for t in range(tp):
                if (t, e) not in out:
                    continue
                local = f"experts.local_experts.{j}."
                out[(t, e)][local + "linear_fc1.weight"] = torch.cat([gate[t], up[t]], dim=0).contiguous()
                out[(t, e)][local + "linear_fc2.weight"] = down[t].contiguous()
    return out


def moe_layer_to_hf(
    shards: dict[tuple[int, int], dict[str, torch.Tensor]], prefix: str, layer: int, moe: MoESpec
) -> dict[str, torch.Tensor]:
    """``{(tp_rank, ep_rank): local state dict}`` of one stage -> the HF tensors of MoE layer ``layer``
    (megatron names ``prefix + 'mlp.'...``)."""
    tp = 1 + max(t for t, _ in shards)
    ep = 1 + max(e for _, e in shards)
    m = prefix + "mlp."
    h = f"model.layers.{layer}.mlp."
    hf = {h + "gate.weight": shards[(0, 0)][m + "router.weight"]}
    for e in range(ep):
        start, end = moe.expert_range(ep, e)
        for j, g in enumerate(range(start, end)):
            local = m + f"experts.local_experts.{j}."
            gates, ups = [], []
            for t in range(tp):
                gt, ut = torch.chunk(shards[(t, e)][local + "linear_fc1.weight"], 2, dim=0)
                gates.append(gt)
                ups.append(ut)
            x = h + f"experts.{g}."
            hf[x + "gate_proj.weight"] = torch.cat(gates, dim=0).contiguous()
            hf[x + "up_proj.weight"] = torch.cat(ups, dim=0).contiguous()
            hf[x + "down_proj.weight"] = torch.cat(
                [shards[(t, e)][local + "linear_fc2.weight"] for t in range(tp)], dim=1
            ).contiguous()
    return hf


_PER_EXPERT = re.compile(
    r"^(?P<head>.*\.mlp\.experts\.)local_experts\.(?P<j>\d+)\.linear_fc(?P<fc>[12])\.weight$"
)
_STACKED = re.compile(r"^(?P<head>.*\.mlp\.experts\.)fc(?P<fc>[12])_weight$")


def stack_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A local state dict in ``SequentialMLP``'s layout
    (``...experts.local_experts.{j}.linear_fc{1,2}.weight``) -> the grouped layout
    (``...experts.fc{1,2}_weight``, experts stacked in local order); other names and an already grouped dict
    pass through. Raises ``ValueError`` naming a tensor that does not stack."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, str]] = {}
    for name, t in sd.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        groups.setdefault(f"{m['head']}fc{m['fc']}_weight", {})[int(m["j"])] = name
    for stacked, by_expert in groups.items():
        names = [by_expert.get(j) for j in range(len(by_expert))]
        if None in names:
            raise ValueError(f"{stacked}: local experts {sorted(by_expert)} are not 0..{len(by_expert) - 1}")
        first = sd[names[0]]
        for name in names:
            if sd[name].shape != first.shape or sd[name].dtype != first.dtype:
                raise ValueError(
                    f"{name}: shape {tuple(sd[name].shape)} {sd[name].dtype} differs from {names[0]}'s "
                    f"{tuple(first.shape)} {first.dtype}"
                )
        out[stacked] = torch.stack([sd[name] for name in names])
    return out


def unstack_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`stack_experts`: grouped expert weights -> one tensor per local expert."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = t
            continue
        for j, w in enumerate(t.unbind(0)):
            out[f"{m['head']}local_experts.{j}.linear_fc{m['fc']}.weight"] = w.contiguous()
    return out


def expert_layout(sd: dict[str, torch.Tensor], grouped: bool) -> dict[str, torch.Tensor]:
    """``sd`` with its expert weights in the grouped (``grouped``) or the per-expert layout, whichever it
    was in (bit-exact: a stack or an unbind)."""
    return stack_experts(sd) if grouped else unstack_experts(sd)


def is_expert_param(name: str) -> bool:
    """A megatron parameter that lives on one expert-parallel rank only (not the router)."""
    return ".mlp.experts." in name


# ---- routing replay -------------------------------------------------------------------------------
class RouterReplay:
    """Installed as ``router.router_replay`` on each megatron ``TopKRouter`` (megatron's top-k routing
    calls its ``get_replay_topk``). With no target it is megatron's own top-k; with ``target`` (int
    ``[tokens, k]`` in the router's token order, ``-1`` rows = no record) it forces those indices and
    gathers the scores at them; ``record`` keeps the indices it returned."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None
        self.record = False
        self.recorded: torch.Tensor | None = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, idx = default_compute_topk(scores, topk, num_groups, group_topk)
        if self.target is not None:
            target = self.target.to(device=scores.device, dtype=idx.dtype)
            if target.shape != idx.shape:
                raise ValueError(
                    f"replayed routing has shape {tuple(target.shape)}, the router {tuple(idx.shape)}"
                )
            known = (target >= 0).all(-1, keepdim=True)
            idx = torch.where(known, target, idx)
            values = scores.gather(1, idx)
        if self.record:
            self.recorded = idx.detach()
        return values, idx


def routers(model: torch.nn.Module) -> list[Any]:
    """The model's ``TopKRouter`` modules in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def install_router_replay(model: torch.nn.Module) -> int:
    """Put a :class:`RouterReplay` on every router of ``model`` (idle until a target is set)."""
    rs = routers(model)
    for r in rs:
        r.router_replay = RouterReplay()
    return len(rs)


def router_order(routed: torch.Tensor, packed_index: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, s, layers, k]`` (the micro-batch's padded layout) -> ``[layers, tokens, k]`` in the order a
    megatron router sees the tokens: sequence-major ``[s, b]`` flattened, or the packed order."""
    b, s, L, k = routed.shape
    if packed_index is not None:
        return routed.reshape(b * s, L, k)[packed_index].permute(1, 0, 2)
    return routed.permute(1, 0, 2, 3).reshape(s * b, L, k).permute(1, 0, 2)


@contextlib.contextmanager
def replay_routing(
    model: torch.nn.Module, routed: torch.Tensor | None, packed_index: torch.Tensor | None = None
) -> Iterator[None]:
    """While inside, ``model``'s routers use the recorded experts ``routed`` (``[b, s, layers, k]``,
    ``-1`` = no record); a no-op when ``routed`` is None."""
    if routed is None:
        yield
        return
    rs = routers(model)
    per_layer = router_order(routed, packed_index)
    if per_layer.shape[0] != len(rs):
        raise ValueError(f"routing recorded for {per_layer.shape[0]} layers, the model has {len(rs)} routers")
    for r, target in zip(rs, per_layer, strict=True):
        if not isinstance(r.router_replay, RouterReplay):
            raise RuntimeError(
                "the model's routers have no RouterReplay; build it with install_router_replay"
            )
        r.router_replay.target = target.contiguous()
    try:
        yield
    finally:
        for r in rs:
            r.router_replay.target = None


@contextlib.contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collects, per layer, the top-k indices the routers chose in the forwards run inside (router order)."""
    rs = routers(model)
    out: list[torch.Tensor] = []
    for r in rs:
        r.router_replay.record = True
    try:
        yield out
    finally:
        for r in rs:
            r.router_replay.record = False
            out.append(r.router_replay.recorded)
            r.router_replay.recorded = None


def routed_tensor(
    records: list[str | None], lengths: list[int], shape: tuple[int, int], num_layers: int, topk: int
) -> torch.Tensor:
    """The micro-batch's ``[b, s, layers, k]`` int32 routing from each row's SGLang record (positions past
    a record, padding and rows without one are ``-1``)."""
    b, s = shape
    out = torch.full((b, s, num_layers, topk), -1, dtype=torch.int32)
    for row, (rec, n) in enumerate(zip(records, lengths, strict=True)):
        if rec is None:
            continue
        arr = torch.from_numpy(decode_routed_experts(rec, num_layers, topk).copy())
        m = min(n, arr.shape[0], s)
        out[row, :m] = arr[:m]
    return out


def attach_routing(
    mb: MicroBatch,
    rows: list[Trajectory],
    moe: MoESpec,
    num_layers: int,
    replay: bool,
    device: torch.device,
) -> None:
    """A micro-batch of a MoE model gets its padding mask (padding stays out of the load-balancing loss;
    packed rows have none) and, with routing ``replay``, the engine's recorded experts of its ``rows``
    (``[b, s, layers, k]``, :func:`routed_tensor`)."""
    lengths = [input_length(t) for t in rows]
    b, s = mb.tokens.shape[0], mb.tokens.shape[1]
    if mb.packed is None:
        ends = torch.tensor(lengths + [0] * (b - len(rows)))
        mb.padding_mask = (torch.arange(s)[None, :] >= ends[:, None]).to(device)
    if replay:
        records = [t.routed_experts for t in rows]
        mb.routed_experts = routed_tensor(records, lengths, (b, s), num_layers, moe.topk).to(device)


# ---- load-balancing loss ----------------------------------------------------------------------------
def set_aux_loss_scale(scale: float, device: torch.device) -> None:
    """The factor the load-balancing loss's gradient gets in the next backward passes (megatron's
    ``MoEAuxLossAutoScaler``): 1 / (micro-batches summed into one step)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32, device=device))


def pop_aux_loss(num_forwards: int) -> float | None:
    """The load-balancing loss (unscaled, mean over layers and over the ``num_forwards`` training forwards
    since the last call) that megatron's routers logged; clears the log. None when nothing was logged."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    value = None
    if entry is not None and num_forwards > 0:
        v = entry["values"].detach().float()
        value = float(v.mean()) / num_forwards
    clear_aux_losses_tracker()
    return value


__all__ = [
    "RouterReplay",
    "attach_routing",
    "check_moe_tensors",
    "expert_layout",
    "hf_moe_names",
    "hf_moe_shapes",
    "install_router_replay",
    "is_expert_param",
    "moe_layer_to_hf",
    "moe_layer_to_mcore",
    "pop_aux_loss",
    "record_routing",
    "replay_routing",
    "routed_tensor",
    "router_order",
    "routers",
    "set_aux_loss_scale",
    "stack_experts",
    "transformer_kwargs",
    "unstack_experts",
]
