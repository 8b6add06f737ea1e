"""Mixture-of-experts model facts that the engine and the trainer share: which MoE families agentrl
serves (Qwen3-MoE) and which it refuses by name, the MoE shape read from an HF config, and the wire format
of routing records (SGLang's ``meta_info["routed_experts"]``: base64 of int32 ``[tokens, layers, k]``).
The trainer's MoE layer, weight mapping and routing replay live in :mod:`agentrl.trainer.moe`; the
engine's expert compute (the decoder layer's MoE MLP) in :mod:`agentrl.models.decoder`."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MOE_MODEL_TYPES = ("qwen3_moe",)

# model_type -> the family's name, for the refusal message
UNSUPPORTED_MOE_FAMILIES = {
    "mixtral": "Mixtral",
    "deepseek_v2": "DeepSeek-V2",
    "deepseek_v3": "DeepSeek-V3",
    "qwen2_moe": "Qwen2-MoE",
    "glm4_moe": "GLM-4.5",
    "olmoe": "OLMoE",
    "gpt_oss": "gpt-oss",
    "llama4": "Llama 4",
    "dbrx": "DBRX",
    "jamba": "Jamba",
    "granitemoe": "Granite-MoE",
    "phimoe": "Phi-MoE",
    "minimax": "MiniMax",
    "ernie4_5_moe": "ERNIE-4.5-MoE",
    "hunyuan_v1_moe": "Hunyuan-MoE",
    "qwen3_next": "Qwen3-Next",
}


def refuse_unsupported_moe(model_type: str | None, config: dict[str, Any] | None = None) -> None:
    """Raise ``ValueError`` naming the family when ``model_type`` is a mixture-of-experts family agentrl
    does not serve (also an unknown type whose config has expert counts)."""
    family = UNSUPPORTED_MOE_FAMILIES.get(str(model_type))
    if family is None and config is not None and model_type not in MOE_MODEL_TYPES:
        if any(config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            family = str(model_type)
    if family is not None:
        raise ValueError(
            f"{family} mixture-of-experts models (model_type {model_type!r}) are not supported; "
            f"the supported MoE family is Qwen3-MoE (model_type 'qwen3_moe')"
        )


@dataclass(frozen=True)
class MoESpec:
    """The MoE shape of a model: every decoder layer's MLP is a routed set of experts."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # per expert (HF moe_intermediate_size)
    norm_topk_prob: bool
    aux_loss_coef: float  # HF router_aux_loss_coef (the trainer's default coefficient)

    @classmethod
    def from_hf_config(cls, c: dict[str, Any]) -> MoESpec | None:
        """The MoE shape of a config.json dict; None for a dense model. Unsupported layouts raise."""
        if c.get("model_type") not in MOE_MODEL_TYPES:
            return None
        n = int(c.get("num_experts") or c.get("num_local_experts") or 0)
        k = int(c.get("num_experts_per_tok") or 0)
        if n < 1 or not 1 <= k <= n:
            raise ValueError(f"num_experts {n} / num_experts_per_tok {k}: need 1 <= k <= num_experts")
        if int(c.get("decoder_sparse_step", 1)) != 1 or c.get("mlp_only_layers"):
            raise ValueError(
                "decoder_sparse_step != 1 / mlp_only_layers (dense layers between MoE layers) are not "
                "supported: every layer must be a mixture-of-experts layer"
            )
        if c.get("shared_expert_intermediate_size"):
            raise ValueError("shared experts (shared_expert_intermediate_size) are not supported")
        return cls(
            num_experts=n,
            topk=k,
            ffn_hidden_size=int(c["moe_intermediate_size"]),
            norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            aux_loss_coef=float(c.get("router_aux_loss_coef", 0.0) or 0.0),
        )

    def expert_range(self, ep: int, ep_rank: int) -> tuple[int, int]:
        """Global expert indices [start, end) held by expert-parallel rank ``ep_rank``."""
        if self.num_experts % ep:
            raise ValueError(f"{self.num_experts} experts do not split over expert parallel size {ep}")
        n = self.num_experts // ep
        return ep_rank * n, (ep_rank + 1) * n

    def active_ffn_params(self, hidden: int) -> int:
        """Parameters one token's MLP uses per layer: k experts plus the router."""
        return self.topk * 3 * hidden * self.ffn_hidden_size + self.num_experts * hidden

    def total_ffn_params(self, hidden: int) -> int:
        return self.num_experts * 3 * hidden * self.ffn_hidden_size + self.num_experts * hidden


def encode_routed_experts(ids: np.ndarray | torch.Tensor) -> str:
    """int32 ``[tokens, layers, k]`` -> SGLang's ``meta_info["routed_experts"]`` (base64 of the bytes)."""
    arr = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    return base64.b64encode(np.ascontiguousarray(arr, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed_experts(data: str, num_layers: int, topk: int) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` -> int32 ``[tokens, num_layers, topk]``."""
    flat = np.frombuffer(base64.b64decode(data), dtype=np.int32)
    if flat.size % (num_layers * topk):
        raise ValueError(
            f"routed_experts holds {flat.size} ids, not a multiple of layers x k = {num_layers} x {topk}"
        )
    return flat.reshape(-1, num_layers, topk)
