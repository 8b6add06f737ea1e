"""The architecture of a model the trainer runs: :class:`ModelArch`, the shape facts of a supported Hugging
Face causal LM read from its config.json (sizes, heads, norms, RoPE, biases, tied embeddings, the MoE
shape), checked once: an unsupported family or feature raises, naming it, before anything is built.

Supported families: Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm, no qkv bias), Llama and the
mixture-of-experts family Qwen3-MoE. The megatron model built from it and the weight mapping live in
:mod:`agentrl.trainer.model`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentrl.models.moe import MOE_MODEL_TYPES, MoESpec, refuse_unsupported_moe

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", *MOE_MODEL_TYPES)


@dataclass(frozen=True)
class ModelArch:
    """The shape facts of a supported HF causal LM, read from its config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    moe: MoESpec | None = None  # None: a dense model

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | Any) -> ModelArch:
        """Read a config.json dict (or a transformers config object); unsupported features raise."""
        c = cfg if isinstance(cfg, dict) else cfg.to_dict()
        mt = c.get("model_type")
        refuse_unsupported_moe(mt, c)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c.get('hidden_act')!r} is not supported (SwiGLU/silu only)")
        if c.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        rope = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (plain RoPE only)")
        theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        head_dim = c.get("head_dim") or hidden // heads
        if mt in ("llama", *MOE_MODEL_TYPES):
            qkv_bias = bool(c.get("attention_bias", False))
            if qkv_bias:
                raise ValueError(f"{mt} attention_bias=True (o_proj bias) is not supported")
        else:
            qkv_bias = mt == "qwen2"
        if c.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        moe = MoESpec.from_hf_config(c)
        return cls(
            model_type=mt,
            vocab_size=int(c["vocab_size"]),
            hidden_size=hidden,
            ffn_hidden_size=moe.ffn_hidden_size if moe else int(c["intermediate_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=mt in ("qwen3", *MOE_MODEL_TYPES),
            moe=moe,
        )

    @classmethod
    def from_hf_dir(cls, hf_dir: str | Path) -> ModelArch:
        return cls.from_hf_config(json.loads((Path(hf_dir) / "config.json").read_text()))

    def padded_vocab_size(self, tp: int, divisible_by: int = 1) -> int:
        m = tp * divisible_by
        return int(math.ceil(self.vocab_size / m) * m)

    def layer_range(self, pp_rank: int, pp: int) -> tuple[int, int]:
        """Global layer indices [start, end) held by pipeline stage ``pp_rank``."""
        if self.num_layers % pp:
            raise ValueError(f"{self.num_layers} layers do not split evenly into {pp} pipeline stages")
        n = self.num_layers // pp
        return pp_rank * n, (pp_rank + 1) * n

    def num_params(self, active: bool = False) -> int:
        """Parameter count of the HF model (tied embedding counted once); ``active``: for an MoE model,
        only what one token uses (k experts and the router per layer)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        if self.moe is None:
            mlp = 3 * h * self.ffn_hidden_size
        else:
            mlp = self.moe.active_ffn_params(h) if active else self.moe.total_ffn_params(h)
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArch"]
