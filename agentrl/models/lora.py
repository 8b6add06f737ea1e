"""The LoRA merge formula, one for the engine and the trainer: an engine that merged an adapter and one
that loaded the trainer's merged weights then serve the same bits (agentrl.embedded.lora merges
adapters into served weights; agentrl.trainer.lora merges them into the HF weights it writes)."""

from __future__ import annotations

import torch


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``base + (scale · b) @ a`` computed in fp32 on ``base``'s device, in ``base``'s dtype. The scale goes
    on ``b`` first, so a ``b`` that arrives scaled already (a broadcast adapter) merges to the same bits."""
    a, b = a.to(base.device, torch.float32), b.to(base.device, torch.float32)
    return (base.float() + (scale * b) @ a).to(base.dtype)


__all__ = ["merged_weight"]
