"""Models of a named shape with random weights: what benchmarks and scale runs train and serve when the
figures depend on the shape, not on what the weights know.

:func:`build_shape_model` writes an HF directory for a shape name: ``tiny`` (the test model, a Qwen2
family with a BPE tokenizer), ``tiny-moe`` (its Qwen3-MoE sibling) or a full-size shape of
:data:`agentrl.models.tiny.FULL_SHAPES` (Qwen2.5-0.5B, Qwen2.5-7B, Qwen3-30B-A3B, ...), whose tokenizer
files are the tiny model's: every id the tokenizer makes is in the model's vocabulary, and ids above the
tokenizer's decode to nothing. A full-size model is laid out on the meta device and only then given
storage on ``device`` (:func:`save_random_model`), so a 7B or 30B model never exists in float32 nor goes
through transformers' per-module init on the host.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SMALL_SHAPES = ("tiny", "tiny-moe")


def shape_names() -> tuple[str, ...]:
    """Every name :func:`build_shape_model` takes."""
    from agentrl.models.tiny import FULL_SHAPES

    return (*SMALL_SHAPES, *FULL_SHAPES)


def build_shape_model(
    shape: str, out: str | Path, dtype: str = "bfloat16", device: str = "cpu", num_layers: int | None = None
) -> Path:
    """An HF model directory of ``shape`` (:func:`shape_names`) with random weights at ``out``; a
    full-size shape is drawn on ``device`` (a GPU makes a 7B model in seconds), with ``num_layers`` of its
    decoder layers when given (the small shapes keep theirs)."""
    import torch

    from agentrl.models.tiny import build_tiny_model, shape_config

    out = Path(out)
    if shape == "tiny":
        return build_tiny_model(out, arch="qwen2", dtype=dtype)
    if shape == "tiny-moe":
        return build_tiny_model(out, arch="qwen3_moe", dtype=dtype, num_experts=8, num_experts_per_tok=2)
    if shape not in shape_names():
        raise ValueError(f"unknown shape {shape!r}; choose {', '.join(shape_names())}")
    build_tiny_model(out / "tok", arch="qwen2")  # only for its tokenizer files
    save_random_model(shape_config(shape, num_layers), getattr(torch, dtype), device, out)
    for f in TOKENIZER_FILES:
        shutil.copy(out / "tok" / f, out / f)
    shutil.rmtree(out / "tok")
    return out


def save_random_model(cfg: Any, dtype: Any, device: str, out: Path) -> None:
    """Save a model of ``cfg`` with random weights to ``out`` (safetensors shards of at most 2 GB): its
    matrices drawn from N(0, initializer_range), norms 1, biases 0, made in ``dtype`` on ``device``."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gave a tied LM head storage of its own
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, cfg.initializer_range, generator=g)
            else:
                p.fill_(0.0 if name.endswith(".bias") else 1.0)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2GB")
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the servers plan their KV caches from the memory left free


def parameter_counts(model_dir: str | Path) -> tuple[int, int]:
    """``(total, active a token)`` parameters of the checkpoint in ``model_dir``, from its safetensors
    headers and config (nothing loaded): an MoE model's token uses ``num_experts_per_tok`` of each
    layer's ``num_experts`` experts."""
    import json
    import math

    from safetensors import safe_open

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    # the experts' count: num_experts in Qwen3-MoE configs, num_local_experts as transformers 5 writes it
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    used = cfg.get("num_experts_per_tok") or 0
    total = expert = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                n = math.prod(st.get_slice(name).get_shape())
                total += n
                expert += n if ".experts." in name else 0
    active = total - expert + (expert * used // experts if experts else 0)
    return total, active
