"""The trainer's model: a megatron-core ``GPTModel`` built from a Hugging Face config (its shape facts,
:class:`~agentrl.trainer.arch.ModelArch`, read in :mod:`agentrl.trainer.arch`), and the weight mapping
between the two naming schemes, both ways, with tensor- and pipeline-parallel sharding.

Supported families: Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm, no qkv bias) and Llama; all with
GQA, RoPE (theta from the config), RMSNorm (eps from the config), SwiGLU, tied or untied embeddings. And
the mixture-of-experts family Qwen3-MoE: Qwen3 attention with megatron-core's ``MoELayer`` as every
layer's MLP (the MoE parts and the expert-parallel layout live in :mod:`agentrl.trainer.moe`).
The layer spec is megatron-core's *local* spec (no Transformer Engine) with the core attention swapped
for :class:`~agentrl.trainer.attention.SDPACoreAttention` (torch ``scaled_dot_product_attention``, causal,
GQA), which runs on CPU and uses the flash/efficient kernels on GPU.

Layouts (why the conversion is more than renaming):

- ``linear_qkv`` stacks, per KV group ``g``, the group's query heads then its key head then its value
  head: ``[q_g0 .. q_g(r-1), k_g, v_g]`` over ``g``; tensor parallelism splits whole groups.
- ``linear_fc1`` is ``[gate; up]`` *per TP rank*: rank ``t`` holds ``[gate_t; up_t]``.
- The vocabulary is padded to a multiple of ``tp * make_vocab_size_divisible_by`` and split in rows;
  padded rows are zero and their logits are masked out by the loss code (``true_vocab_size``).
- Pipeline stage ``p`` owns layers ``[p*L/pp, (p+1)*L/pp)`` under local names starting at 0; with tied
  embeddings and ``pp > 1`` the last stage holds a copy of the embedding as ``output_layer.weight``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from agentrl.trainer.arch import ModelArch
from agentrl.trainer.attention import SDPACoreAttention
from agentrl.trainer.moe import (
    expert_layout,
    hf_moe_shapes,
    install_router_replay,
    is_expert_param,
    moe_layer_to_hf,
    moe_layer_to_mcore,
    unstack_experts,
)


# ---- model ----------------------------------------------------------------------------------------
def transformer_config(
    arch: ModelArch,
    tp: int = 1,
    pp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    recompute: bool = False,
    fused_swiglu: bool = False,
    ep: int = 1,
    moe_aux_loss_coef: float | None = None,
) -> Any:
    """The megatron ``TransformerConfig`` of ``arch`` for the given parallel sizes. ``fused_swiglu``:
    megatron's SwiGLU compiled by torch.compile (its ``bias_activation_fusion``), the one fusion without
    TE/apex. ``ep`` / ``moe_aux_loss_coef``: MoE models only (expert-parallel size; None: the HF config's
    coefficient)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = params_dtype == torch.bfloat16
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        params_dtype=params_dtype,
        bf16=bf16,
        pipeline_dtype=params_dtype,
        # the other fusions need TE/apex kernels; the local spec runs the plain torch ops
        bias_activation_fusion=fused_swiglu,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights always come from a checkpoint
    )
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if arch.moe is not None:
        from agentrl.trainer.moe import transformer_kwargs

        kwargs.update(transformer_kwargs(arch.moe, ep, moe_aux_loss_coef))
    elif ep != 1:
        raise ValueError("expert parallelism (ep > 1) needs a mixture-of-experts model")
    return TransformerConfig(**kwargs)


def layer_spec(arch: ModelArch, grouped_experts: bool = False) -> Any:
    """megatron-core's local GPT layer spec with :class:`SDPACoreAttention` as core attention. An MoE
    model's experts: megatron's ``SequentialMLP``, or with ``grouped_experts`` agentrl's
    :class:`~agentrl.trainer.experts.GroupedExperts` (megatron's own grouped modules need Transformer Engine
    or the grouped_gemm package)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    num_experts = arch.moe.num_experts if arch.moe is not None else None
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
    )
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if num_experts is not None and grouped_experts:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from agentrl.trainer.experts import GroupedExperts

        mlp = spec.submodules.mlp
        if isinstance(mlp, functools.partial):  # newer megatron-core: builders, MoELayer's in a partial
            mlp.keywords["submodules"].experts = GroupedExperts
        else:  # older: ModuleSpecs
            mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    return spec


def build_gpt_model(
    arch: ModelArch,
    tp: int = 1,
    pp: int = 1,
    pp_rank: int = 0,
    params_dtype: torch.dtype = torch.float32,
    vocab_divisible_by: int = 1,
    recompute: bool = False,
    fused_swiglu: bool = False,
    compile_layers: bool = False,
    ep: int = 1,
    moe_aux_loss_coef: float | None = None,
    grouped_experts: bool = False,
) -> Any:
    """A megatron ``GPTModel`` for this rank (megatron's ``parallel_state`` must be initialized). An MoE
    model's routers carry an idle :class:`~agentrl.trainer.moe.RouterReplay` (routing replay);
    ``grouped_experts``: its experts stacked and run grouped (see :func:`layer_spec`)."""
    from megatron.core.models.gpt import GPTModel

    cfg = transformer_config(arch, tp, pp, params_dtype, recompute, fused_swiglu, ep, moe_aux_loss_coef)
    if arch.moe is not None:
        from agentrl.trainer.mcore_compat import apply_moe_patches

        apply_moe_patches()
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=layer_spec(arch, grouped_experts),
        vocab_size=arch.padded_vocab_size(tp, vocab_divisible_by),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,
    )
    for param in model.parameters():  # torch's norms are built in fp32; in params_dtype rms_norm runs fused
        param.data = param.data.to(params_dtype)
    mark_tensor_parallel_params(model)
    if arch.moe is not None:
        install_router_replay(model)
    if compile_layers:
        compile_transformer_layers(model)
    return model


def compile_transformer_layers(model: torch.nn.Module) -> None:
    """torch.compile every transformer layer in place (one graph shared by all layers). Shapes start static;
    a dimension that changes between calls (a micro-batch's length) is made dynamic on the recompile, so
    the fixed ones (heads, head size, hidden) stay constants in the kernels' index math, which a fully
    dynamic graph turns into integer divisions by runtime sizes (RoPE's kernel took 1.8x as long that way
    on an H100). Parameter names and the state dict are unchanged."""
    from agentrl.trainer.mcore_compat import quiet_default_tp_group

    quiet_default_tp_group()  # a warning inside every layer would split its graph
    for layer in model.decoder.layers:
        layer.compile()


def mark_tensor_parallel_params(model: torch.nn.Module) -> None:
    """Tag TP-sharded weights with megatron's ``tensor_model_parallel`` attributes.

    Megatron sets them inside its weight initializers, which ``perform_initialization=False`` skips
    (weights come from checkpoints). Gradient-norm clipping, DDP and the distributed optimizer read
    them to count TP-duplicated parameters (norms) once.
    """
    from megatron.core.tensor_parallel import layers as tpl

    for mod in model.modules():
        if isinstance(mod, tpl.ColumnParallelLinear | tpl.VocabParallelEmbedding):
            dim, params = 0, [mod.weight, getattr(mod, "bias", None)]
        elif isinstance(mod, tpl.RowParallelLinear):
            dim, params = 1, [mod.weight]  # its bias (none here) is not sharded
        else:
            continue
        for i, p in enumerate(params):
            if p is None or not isinstance(p, torch.nn.Parameter) or hasattr(p, "tensor_model_parallel"):
                continue
            tpl.set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0 if i else dim, stride=1)


# ---- HF <-> Megatron weights ----------------------------------------------------------------------
def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _mc_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _split_rows(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    return [x.contiguous() for x in torch.chunk(t, tp, dim=0)]


def _split_cols(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    return [x.contiguous() for x in torch.chunk(t, tp, dim=1)]


def _qkv_to_mcore(
    arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp: int
) -> list[torch.Tensor]:
    """HF q/k/v (weights [out, in] or biases [out]) -> per-TP-rank interleaved ``linear_qkv`` shards."""
    ng, hd = arch.num_kv_heads, arch.head_dim
    r = arch.num_attention_heads // ng
    if ng % tp:
        raise ValueError(f"{ng} KV heads do not split over tensor parallel size {tp}")
    rest = q.shape[1:]
    qg = q.reshape(ng, r * hd, *rest)
    kg = k.reshape(ng, hd, *rest)
    vg = v.reshape(ng, hd, *rest)
    fused = torch.cat([qg, kg, vg], dim=1)  # [ng, (r+2)*hd, ...]
    return [x.reshape(-1, *rest).contiguous() for x in torch.chunk(fused, tp, dim=0)]


def _qkv_to_hf(
    arch: ModelArch, shards: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, hd = arch.num_kv_heads, arch.head_dim
    r = arch.num_attention_heads // ng
    full = torch.cat(shards, dim=0)
    rest = full.shape[1:]
    g = full.reshape(ng, (r + 2) * hd, *rest)
    q, k, v = torch.split(g, [r * hd, hd, hd], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def _pad_vocab(w: torch.Tensor, padded: int) -> torch.Tensor:
    if w.shape[0] == padded:
        return w
    pad = torch.zeros(padded - w.shape[0], *w.shape[1:], dtype=w.dtype)
    return torch.cat([w, pad], dim=0)


def hf_to_mcore_shards(
    hf: Mapping[str, torch.Tensor],
    arch: ModelArch,
    tp: int = 1,
    pp: int = 1,
    vocab_divisible_by: int = 1,
    ranks: list[tuple[int, ...]] | None = None,
    ep: int = 1,
    grouped_experts: bool = False,
) -> dict[tuple[int, ...], dict[str, torch.Tensor]]:
    """HF state dict -> ``{(pp_rank, tp_rank): megatron local state dict}`` (only ``ranks`` if given); with
    expert parallelism (``ep > 1``, MoE models) the keys are ``(pp_rank, tp_rank, ep_rank)``. A tensor
    whose expert count or shape does not fit the config raises ``ValueError`` naming it.
    ``grouped_experts``: MoE expert weights in the stacked layout of
    :class:`~agentrl.trainer.experts.GroupedExperts` (else ``SequentialMLP``'s, one tensor per expert)."""
    if ep > 1 and arch.moe is None:
        raise ValueError("expert parallelism (ep > 1) needs a mixture-of-experts model")
    all_ranks = [(p, t, e) for p in range(pp) for t in range(tp) for e in range(ep)]
    wanted = {r if len(r) == 3 else (*r, 0) for r in ranks} if ranks is not None else set(all_ranks)
    out: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {key: {} for key in wanted}
    padded = arch.padded_vocab_size(tp, vocab_divisible_by)

    def put(p: int, name: str, shards: list[torch.Tensor] | torch.Tensor) -> None:
        for t in range(tp):
            for e in range(ep):
                if (p, t, e) in wanted:
                    out[(p, t, e)][name] = shards if isinstance(shards, torch.Tensor) else shards[t]

    emb = hf["model.embed_tokens.weight"]
    put(0, "embedding.word_embeddings.weight", _split_rows(_pad_vocab(emb, padded), tp))
    last = pp - 1
    put(last, "decoder.final_layernorm.weight", hf["model.norm.weight"])
    if not arch.tie_word_embeddings:
        put(last, "output_layer.weight", _split_rows(_pad_vocab(hf["lm_head.weight"], padded), tp))
    elif pp > 1:  # the last stage keeps its own copy of the tied embedding
        put(last, "output_layer.weight", _split_rows(_pad_vocab(emb, padded), tp))

    for p in range(pp):
        if not any(key[0] == p for key in wanted):
            continue
        start, end = arch.layer_range(p, pp)
        for i in range(start, end):
            h, m = _hf_layer(i), _mc_layer(i - start)
            a = h + "self_attn."
            put(p, m + "input_layernorm.weight", hf[h + "input_layernorm.weight"])
            put(p, m + "pre_mlp_layernorm.weight", hf[h + "post_attention_layernorm.weight"])
            put(
                p,
                m + "self_attention.linear_qkv.weight",
                _qkv_to_mcore(
                    arch, hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], tp
                ),
            )
            if arch.qkv_bias:
                put(
                    p,
                    m + "self_attention.linear_qkv.bias",
                    _qkv_to_mcore(
                        arch, hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], tp
                    ),
                )
            if arch.qk_norm:
                put(p, m + "self_attention.q_layernorm.weight", hf[a + "q_norm.weight"])
                put(p, m + "self_attention.k_layernorm.weight", hf[a + "k_norm.weight"])
            put(p, m + "self_attention.linear_proj.weight", _split_cols(hf[a + "o_proj.weight"], tp))
            if arch.moe is not None:
                mine = {(t, e) for q, t, e in wanted if q == p}  # only this stage's ranks' experts are read
                experts = moe_layer_to_mcore(hf, i, arch.moe, arch.hidden_size, tp, ep, wanted=mine)
                for (t, e), tensors in experts.items():
                    out[(p, t, e)].update({m + "mlp." + k: v for k, v in tensors.items()})
                continue
            gate = _split_rows(hf[h + "mlp.gate_proj.weight"], tp)
            up = _split_rows(hf[h + "mlp.up_proj.weight"], tp)
            put(
                p,
                m + "mlp.linear_fc1.weight",
                [torch.cat([g, u], dim=0) for g, u in zip(gate, up, strict=True)],
            )
            put(p, m + "mlp.linear_fc2.weight", _split_cols(hf[h + "mlp.down_proj.weight"], tp))
    if grouped_experts:
        out = {key: expert_layout(d, grouped=True) for key, d in out.items()}
    if ep == 1:
        return {(p, t): d for (p, t, _), d in out.items()}
    return out  # type: ignore[return-value]


def mcore_to_hf(
    shards: dict[tuple[int, ...], dict[str, torch.Tensor]], arch: ModelArch
) -> dict[str, torch.Tensor]:
    """``{(pp_rank, tp_rank): local state dict}`` (all ranks; ``(pp_rank, tp_rank, ep_rank)`` keys for an
    expert-parallel MoE layout; expert weights per expert or stacked) -> HF state dict with HF names."""
    by_ep = {k if len(k) == 3 else (*k, 0): unstack_experts(d) for k, d in shards.items()}
    shards = {(p, t): d for (p, t, e), d in by_ep.items() if e == 0}  # type: ignore[assignment]
    pp = 1 + max(p for p, _ in shards)
    tp = 1 + max(t for _, t in shards)
    hf: dict[str, torch.Tensor] = {}
    V = arch.vocab_size

    def cat_rows(p: int, name: str) -> torch.Tensor:
        return torch.cat([shards[(p, t)][name] for t in range(tp)], dim=0)

    def cat_cols(p: int, name: str) -> torch.Tensor:
        return torch.cat([shards[(p, t)][name] for t in range(tp)], dim=1)

    hf["model.embed_tokens.weight"] = cat_rows(0, "embedding.word_embeddings.weight")[:V].contiguous()
    hf["model.norm.weight"] = shards[(pp - 1, 0)]["decoder.final_layernorm.weight"]
    if not arch.tie_word_embeddings:
        hf["lm_head.weight"] = cat_rows(pp - 1, "output_layer.weight")[:V].contiguous()
    for p in range(pp):
        start, end = arch.layer_range(p, pp)
        for i in range(start, end):
            h, m = _hf_layer(i), _mc_layer(i - start)
            a = h + "self_attn."
            first = shards[(p, 0)]
            hf[h + "input_layernorm.weight"] = first[m + "input_layernorm.weight"]
            hf[h + "post_attention_layernorm.weight"] = first[m + "pre_mlp_layernorm.weight"]
            q, k, v = _qkv_to_hf(
                arch, [shards[(p, t)][m + "self_attention.linear_qkv.weight"] for t in range(tp)]
            )
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"] = q, k, v
            if arch.qkv_bias:
                q, k, v = _qkv_to_hf(
                    arch, [shards[(p, t)][m + "self_attention.linear_qkv.bias"] for t in range(tp)]
                )
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"] = q, k, v
            if arch.qk_norm:
                hf[a + "q_norm.weight"] = first[m + "self_attention.q_layernorm.weight"]
                hf[a + "k_norm.weight"] = first[m + "self_attention.k_layernorm.weight"]
            hf[a + "o_proj.weight"] = cat_cols(p, m + "self_attention.linear_proj.weight")
            if arch.moe is not None:
                stage = {(t, e): d for (q, t, e), d in by_ep.items() if q == p}
                hf.update(moe_layer_to_hf(stage, m, i, arch.moe))
                continue
            gates, ups = [], []
            for t in range(tp):
                g, u = torch.chunk(shards[(p, t)][m + "mlp.linear_fc1.weight"], 2, dim=0)
                gates.append(g)
                ups.append(u)
            hf[h + "mlp.gate_proj.weight"] = torch.cat(gates, dim=0).contiguous()
            hf[h + "mlp.up_proj.weight"] = torch.cat(ups, dim=0).contiguous()
            hf[h + "mlp.down_proj.weight"] = cat_cols(p, m + "mlp.linear_fc2.weight")
    return hf


def gather_hf_state_dict(
    module: torch.nn.Module, arch: ModelArch, ps: Any, device: torch.device | str | None = "cpu"
) -> dict[str, torch.Tensor]:
    """The full HF-named state dict of a GPTModel sharded over TP and PP, assembled on every rank
    (collective over both; ``ps``: megatron's parallel_state), its tensors on ``device``.

    ``device=None``: this rank takes part in the collectives for the others and keeps nothing (returns
    ``{}``); its own shards still travel to the other pipeline stages. A rank that hands no weights over
    calls it so: copying the whole model off the GPU only to drop it takes seconds at 7B."""
    keep = device is not None
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    # where this rank holds what it gathers: on ``device``; without one, what the other pipeline stages
    # need from it, on the CPU, or else nothing
    hold = device if keep else ("cpu" if pp > 1 else None)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    local = {
        k: v.detach()
        for k, v in module.state_dict().items()
        if not k.endswith("_extra_state") and v is not None
    }
    shards: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
    tp_group = ps.get_tensor_model_parallel_group()
    ep = ps.get_expert_model_parallel_world_size() if arch.moe is not None else 1
    for name in sorted(local):
        t = local[name].contiguous()
        if tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t, group=tp_group)
        else:
            parts = [t]
        if ep > 1 and is_expert_param(name):  # each expert-parallel rank holds other experts
            for r, part in enumerate(parts):
                held = [torch.empty_like(part) for _ in range(ep)]
                dist.all_gather(held, part.contiguous(), group=ps.get_expert_model_parallel_group())
                for e, x in enumerate(held):
                    if hold is not None:
                        shards.setdefault((pp_rank, r, e), {})[name] = x.to(hold)
            continue
        for r, part in enumerate(parts):
            if hold is not None:
                key = (pp_rank, r) if ep == 1 else (pp_rank, r, 0)
                shards.setdefault(key, {})[name] = part.to(hold)
    if pp > 1:
        gathered: list[Any] = [None] * pp
        dist.all_gather_object(
            gathered,
            {k: {n: v.cpu() for n, v in d.items()} for k, d in shards.items()},
            group=ps.get_pipeline_model_parallel_group(),
        )
        if not keep:
            return {}
        shards = {k: {n: v.to(device) for n, v in d.items()} for part in gathered for k, d in part.items()}
    return mcore_to_hf(shards, arch) if keep else {}


def hf_param_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of ``arch`` (what a full HF checkpoint must hold)."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = _hf_layer(i)
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        }
        if arch.moe is not None:
            shapes |= hf_moe_shapes(i, arch.moe, h)
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (arch.ffn_hidden_size, h),
                p + "mlp.up_proj.weight": (arch.ffn_hidden_size, h),
                p + "mlp.down_proj.weight": (h, arch.ffn_hidden_size),
            }
        if arch.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if arch.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


# ---- safetensors I/O ------------------------------------------------------------------------------
def load_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF dir (single ``model.safetensors`` or an indexed, sharded checkpoint)."""
    lazy = LazyHFStateDict(hf_dir)
    return {name: lazy[name] for name in lazy}


class LazyHFStateDict(Mapping[str, torch.Tensor]):
    """The tensors of an HF dir (single ``model.safetensors`` or an indexed, sharded checkpoint), each read
    from its file when asked for, and their shapes without reading them (:meth:`shape`): a rank takes its
    share of a large checkpoint (its experts, its tensor-parallel slices' tensors) without holding the rest.
    A tied checkpoint's stored ``lm_head.weight`` alias is left out, as :func:`load_hf_state_dict` does."""

    def __init__(self, hf_dir: str | Path) -> None:
        from safetensors import safe_open

        d = Path(hf_dir)
        index = d / "model.safetensors.index.json"
        if index.is_file():
            where = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(str(d / "model.safetensors"), framework="pt") as f:
                where = dict.fromkeys(f.keys(), "model.safetensors")
        if "lm_head.weight" in where and "model.embed_tokens.weight" in where:
            if json.loads((d / "config.json").read_text()).get("tie_word_embeddings", False):
                del where["lm_head.weight"]  # some tied checkpoints store the alias too
        self._dir, self._where = d, where
        self._files: dict[str, Any] = {}  # file name -> its open safetensors handle

    def _file(self, name: str) -> Any:
        from safetensors import safe_open

        file = self._where[name]
        if file not in self._files:
            self._files[file] = safe_open(str(self._dir / file), framework="pt")
        return self._files[file]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, read from its file's header."""
        return tuple(self._file(name).get_slice(name).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where


HF_AUX_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def save_hf_dir(
    hf: dict[str, torch.Tensor],
    out_dir: str | Path,
    template_dir: str | Path,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``hf`` as ``model.safetensors`` plus the template's config/tokenizer files."""
    import shutil

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in HF_AUX_FILES:
        src = Path(template_dir) / name
        if src.is_file() and src.resolve() != (out / name).resolve():
            shutil.copyfile(src, out / name)
    tensors = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in hf.items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")  # atomic: an engine never reads a half-written file
    stale_index = out / "model.safetensors.index.json"
    if stale_index.exists():
        stale_index.unlink()
    return out
