"""Low-rank adapters (LoRA) on the trainer's megatron-core linear layers, and their PEFT form.

Each adapted linear layer ``y = W x`` becomes ``y = W x + s · B (A x)`` with ``s = alpha / rank``, ``A``
``[rank, in]`` and ``B`` ``[out, rank]``; ``W`` is frozen and only ``A`` and ``B`` train. The adapter is a
submodule ``adapter`` of the linear layer (its parameters ``...linear_qkv.adapter.lora_A`` / ``lora_B``),
added to the layer's output by a forward hook, so the base weights keep their names and every existing
path (checkpoints, HF conversion) sees them unchanged.

Tensor parallelism follows the base layer's split:

* column parallel (``linear_qkv``, ``linear_fc1``): ``A`` replicated, ``B`` split along the output like
  ``W``. ``A x`` enters the parallel region through megatron's ``copy_to_tensor_model_parallel_region``
  (identity forward, all-reduce backward), so ``A``'s gradient is the full one on every rank.
* row parallel (``linear_proj``, ``linear_fc2``): ``A`` split along the input like ``W``, ``B`` replicated;
  the rank-sized ``A x`` is all-reduced (``reduce_from_tensor_model_parallel_region``) before ``B``.

Initialisation as PEFT's: ``A`` kaiming-uniform (``a = sqrt(5)``: uniform in ``±1/sqrt(in)``), ``B`` zero,
so the model at step 0 is the base model bit for bit. ``A`` is drawn whole from a generator seeded by the
run's seed and the layer, then sliced, so every tensor-parallel size starts from the same adapters.

The fused megatron layers hold one adapter for several HF modules: ``linear_qkv`` for q/k/v and
``linear_fc1`` for gate/up. Exported to PEFT (:func:`peft_state_dict`) such an adapter becomes one
adapter per HF module, each with the same ``A`` and its rows of ``B``, which computes exactly the same
thing. When only some of the fused modules are targets, the other rows of ``B`` are masked to zero.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from agentrl.trainer.arch import ModelArch
from agentrl.trainer.config import LoRAConfig
from agentrl.trainer.model import _qkv_to_hf, _qkv_to_mcore, _split_cols, _split_rows

# megatron module (inside decoder.layers.{i}.) -> (parallel kind, HF module names it computes, HF prefix)
FUSED: dict[str, tuple[str, tuple[str, ...], str]] = {
    "self_attention.linear_qkv": ("column", ("q_proj", "k_proj", "v_proj"), "self_attn."),
    "self_attention.linear_proj": ("row", ("o_proj",), "self_attn."),
    "mlp.linear_fc1": ("column", ("gate_proj", "up_proj"), "mlp."),
    "mlp.linear_fc2": ("row", ("down_proj",), "mlp."),
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(" + "|".join(re.escape(k) for k in FUSED) + r")$")
PEFT_PREFIX = "base_model.model."


def _fused_linears(
    module: torch.nn.Module, first_layer: int, adapted: bool = False
) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """(global layer index, megatron name of the linear, the linear) of every adaptable linear of
    ``module``'s layers (``adapted``: only those holding an adapter); listed first, so the caller may add
    modules while it walks them."""
    for name, m in list(module.named_modules()):
        hit = _LAYER.match(name)
        if hit is not None and (not adapted or hasattr(m, "adapter")):
            yield first_layer + int(hit.group(1)), hit.group(2), m


class LoRAAdapter(torch.nn.Module):
    """The ``A``/``B`` pair of one linear layer (this rank's shards) and how it adds ``s · B (A x)``."""

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        scale: float,
        kind: str,
        tp: int,
        dropout: float,
        mask: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)
        self.scale, self.kind, self.tp = scale, kind, tp
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        # rows of B whose HF module is not a target stay zero (a fused layer, some of its modules adapted)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        h = F.linear(self.dropout(x), self.lora_A)
        if self.tp > 1:
            if self.kind == "column":
                h = mappings.copy_to_tensor_model_parallel_region(h)
            else:
                h = mappings.reduce_from_tensor_model_parallel_region(h)
        b = self.lora_B if self.mask is None else self.lora_B * self.mask
        return F.linear(h, b) * self.scale


def _add_adapter_output(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    out, bias = output  # megatron's parallel linears return (output, bias)
    return out + module.adapter(args[0]).to(out.dtype), bias


def _targets(cfg: LoRAConfig, hf_names: tuple[str, ...]) -> list[str]:
    return [n for n in hf_names if n in cfg.target_modules]


def _b_rows(arch: ModelArch, hf_name: str) -> int:
    """The output size of HF module ``hf_name`` (its ``B``'s rows)."""
    if hf_name == "q_proj":
        return arch.num_attention_heads * arch.head_dim
    if hf_name in ("k_proj", "v_proj"):
        return arch.num_kv_heads * arch.head_dim
    return arch.ffn_hidden_size if hf_name in ("gate_proj", "up_proj") else arch.hidden_size


def _in_features(arch: ModelArch, suffix: str) -> int:
    if suffix == "self_attention.linear_proj":
        return arch.num_attention_heads * arch.head_dim
    return arch.ffn_hidden_size if suffix == "mlp.linear_fc2" else arch.hidden_size


def local_b(
    arch: ModelArch, suffix: str, parts: dict[str, torch.Tensor], tp: int, tp_rank: int
) -> torch.Tensor:
    """This rank's rows of a layer's ``B`` (or of a row mask) from its HF modules' full ``B`` ``parts``."""
    if suffix == "self_attention.linear_qkv":
        return _qkv_to_mcore(arch, parts["q_proj"], parts["k_proj"], parts["v_proj"], tp)[tp_rank]
    if suffix == "mlp.linear_fc1":
        return torch.cat(
            [_split_rows(parts["gate_proj"], tp)[tp_rank], _split_rows(parts["up_proj"], tp)[tp_rank]]
        )
    return next(iter(parts.values()))  # row parallel: B replicated


def local_a(suffix: str, a: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's share of a layer's full ``A``: all of it (column parallel) or its input columns (row)."""
    return a if FUSED[suffix][0] == "column" else _split_cols(a, tp)[tp_rank]


def _init_a(rank: int, fan_in: int, seed: int, layer: int, suffix: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 16 + list(FUSED).index(suffix))
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)), PEFT's default for A
    return (torch.rand(rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def add_lora(
    model: torch.nn.Module,
    cfg: LoRAConfig,
    arch: ModelArch,
    tp: int,
    tp_rank: int,
    first_layer: int = 0,
    seed: int = 0,
) -> int:
    """Freeze ``model`` (a GPTModel on this rank, weights loaded) and add the adapters of ``cfg``;
    ``first_layer``: the global index of this pipeline stage's layer 0. Returns the number of this rank's
    trainable parameters."""
    from megatron.core.tensor_parallel import layers as tpl

    if arch.moe is not None:
        raise ValueError("trainer.lora: dense models only (this is a mixture-of-experts model)")
    for p in model.parameters():
        p.requires_grad_(False)
    scale = cfg.alpha / cfg.rank
    trainable = 0
    for layer, suffix, module in _fused_linears(model, first_layer):
        kind, hf_names, _ = FUSED[suffix]
        targets = _targets(cfg, hf_names)
        if not targets:
            continue
        weight = module.weight
        a = local_a(suffix, _init_a(cfg.rank, _in_features(arch, suffix), seed, layer, suffix), tp, tp_rank)
        b_rows = weight.shape[0] if kind == "column" else arch.hidden_size
        b = torch.zeros(b_rows, cfg.rank)
        mask = None
        if len(targets) < len(hf_names):
            rows = {n: torch.full((_b_rows(arch, n), 1), float(n in targets)) for n in hf_names}
            mask = local_b(arch, suffix, rows, tp, tp_rank).to(weight.device, weight.dtype)
        dtype, device = weight.dtype, weight.device
        adapter = LoRAAdapter(a.to(device, dtype), b.to(device, dtype), scale, kind, tp, cfg.dropout, mask)
        sharded = adapter.lora_B if kind == "column" else adapter.lora_A
        tpl.set_tensor_model_parallel_attributes(
            sharded, is_parallel=True, dim=0 if kind == "column" else 1, stride=1
        )
        module.adapter = adapter
        module.register_forward_hook(_add_adapter_output)
        trainable += a.numel() + b.numel()
    return trainable


def lora_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapter parameters of ``model`` by name (the trainable ones)."""
    return {n: p for n, p in model.named_parameters() if ".adapter.lora_" in n}


def _peft_name(layer: int, prefix: str, hf_name: str, ab: str) -> str:
    return f"{PEFT_PREFIX}model.layers.{layer}.{prefix}{hf_name}.lora_{ab}.weight"


def peft_state_dict(
    module: torch.nn.Module, arch: ModelArch, cfg: LoRAConfig, ps: Any
) -> dict[str, torch.Tensor]:
    """The adapters of a GPTModel sharded over TP and PP as a PEFT state dict (HF module names; a fused
    layer's adapter split per module), assembled on every rank on the CPU (collective over TP and PP)."""
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    first = arch.layer_range(ps.get_pipeline_model_parallel_rank(), pp)[0]
    out: dict[str, torch.Tensor] = {}
    for layer, suffix, m in _fused_linears(module, first, adapted=True):
        kind, hf_names, prefix = FUSED[suffix]
        ad = m.adapter
        a_parts, b_parts = [ad.lora_A.detach()], [ad.lora_B.detach()]
        if tp > 1:
            a_parts = [torch.empty_like(a_parts[0]) for _ in range(tp)]
            b_parts = [torch.empty_like(b_parts[0]) for _ in range(tp)]
            group = ps.get_tensor_model_parallel_group()
            dist.all_gather(a_parts, ad.lora_A.detach().contiguous(), group=group)
            dist.all_gather(b_parts, ad.lora_B.detach().contiguous(), group=group)
        a = a_parts[0] if kind == "column" else torch.cat(a_parts, dim=1)
        if suffix == "self_attention.linear_qkv":
            bs = dict(zip(hf_names, _qkv_to_hf(arch, b_parts), strict=True))
        elif suffix == "mlp.linear_fc1":
            halves = [torch.chunk(b, 2, dim=0) for b in b_parts]
            bs = {
                "gate_proj": torch.cat([h[0] for h in halves]),
                "up_proj": torch.cat([h[1] for h in halves]),
            }
        else:
            bs = {hf_names[0]: b_parts[0]}
        for hf_name in _targets(cfg, hf_names):
            out[_peft_name(layer, prefix, hf_name, "A")] = a.cpu().clone()  # a copy per module
            out[_peft_name(layer, prefix, hf_name, "B")] = bs[hf_name].cpu().clone()
    if pp > 1:
        parts: list[Any] = [None] * pp
        dist.all_gather_object(parts, out, group=ps.get_pipeline_model_parallel_group())
        out = {k: v for part in parts for k, v in part.items()}
    return out


def load_peft_state_dict(
    module: torch.nn.Module,
    peft: dict[str, torch.Tensor],
    arch: ModelArch,
    tp: int,
    tp_rank: int,
    first_layer: int = 0,
) -> None:
    """Set this rank's adapters of ``module`` from a PEFT state dict (the inverse of
    :func:`peft_state_dict`; a fused layer takes ``A`` from its first target module)."""
    for layer, suffix, m in _fused_linears(module, first_layer, adapted=True):
        _, hf_names, prefix = FUSED[suffix]
        present = [n for n in hf_names if _peft_name(layer, prefix, n, "A") in peft]
        if not present:
            raise KeyError(f"no adapter for layer {layer} {suffix} in the PEFT state dict")
        a = peft[_peft_name(layer, prefix, present[0], "A")]
        rank = a.shape[0]
        parts = {
            n: peft[_peft_name(layer, prefix, n, "B")]
            if n in present
            else torch.zeros(_b_rows(arch, n), rank)
            for n in hf_names
        }
        with torch.no_grad():
            m.adapter.lora_A.copy_(local_a(suffix, a, tp, tp_rank))
            m.adapter.lora_B.copy_(local_b(arch, suffix, parts, tp, tp_rank))


def adapter_config(cfg: LoRAConfig, base_model: str) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` of ``cfg``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }


def save_peft_dir(
    tensors: dict[str, torch.Tensor], cfg: LoRAConfig, out_dir: str | Path, base_model: str
) -> Path:
    """Write a PEFT adapter dir: ``adapter_config.json`` and ``adapter_model.safetensors`` (atomically:
    an engine never reads a half-written file)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "adapter_model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(cfg, base_model), indent=2) + "\n")
    return out


def merge_into_hf(
    hf: dict[str, torch.Tensor], peft: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """``hf`` (HF-named base weights) with each adapted weight replaced by ``W + scale · B @ A``: the
    engines' merge (:func:`agentrl.models.lora.merged_weight`), so both give the same bits."""
    from agentrl.models.lora import merged_weight

    out = dict(hf)
    for name, a in peft.items():
        if name.endswith(".lora_A.weight"):
            weight = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") + ".weight"
            out[weight] = merged_weight(hf[weight], a, peft[name.replace(".lora_A.", ".lora_B.")], scale)
    return out
