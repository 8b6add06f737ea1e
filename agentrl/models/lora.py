"""The LoRA formulas, one for the engine and the trainer, merged and unmerged.

* :func:`merged_weight` -- ``W + (s · B) @ A``: an engine that merged an adapter and one that loaded the
  trainer's merged weights then serve the same bits (agentrl.embedded.lora merges adapters into served
  weights; agentrl.trainer.lora merges them into the HF weights it writes).
* :func:`lora_linear` over a :class:`LoraWeight` -- ``x W^T (+ bias) + (x A^T) (s · B)^T``, the trainer's own
  unmerged forward (``W x + s · B (A x)``, agentrl.trainer.lora) with the scale on ``B``: the linear of
  the embedded engine's unmerged LoRA serving (a :class:`agentrl.models.decoder.DecoderOps` takes it, and
  a layer's projection fields the records).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentrl.models.decoder import torch_linear

Tensor = torch.Tensor


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``base + (scale · b) @ a`` computed in fp32 on ``base``'s device, in ``base``'s dtype. The scale goes
    on ``b`` first, so a ``b`` that arrives scaled already (a broadcast adapter) merges to the same bits."""
    a, b = a.to(base.device, torch.float32), b.to(base.device, torch.float32)
    return (base.float() + (scale * b) @ a).to(base.dtype)


def scaled_b(b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale · b`` computed in fp32, in ``dtype``: the ``B`` an unmerged :class:`LoraWeight` holds. As in
    :func:`merged_weight` the scale goes on ``b`` first, and a broadcast adapter's ``B`` arrives as these
    bits (``scale`` 1 then)."""
    return (scale * b.float()).to(dtype)


@dataclass(frozen=True, eq=False)
class LoraWeight:
    """One projection served with an adapter beside it, unmerged: ``base`` is the layer's own weight (the
    model's parameter, or another kernel's record of it such as an fp8 one), ``a`` ``[R, in]`` and ``b``
    ``[out, R]`` are buffers of a fixed rank ``R`` that adapter updates overwrite in place (captured CUDA
    graphs read them), ``b`` holding ``s · B``. An adapter of rank ``r < R`` fills ``a[:r]`` and
    ``b[:, :r]``, the rest zero; ``b`` all zero adds exact zeros: the base model's bits."""

    base: Tensor | object
    a: Tensor
    b: Tensor

    @property
    def shape(self) -> torch.Size:
        return self.b.shape[:1] + self.a.shape[1:]


def lora_linear(
    x: Tensor,
    weight: Tensor | LoraWeight | object,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    *,
    linear: Callable[..., Tensor] = torch_linear,
) -> Tensor:
    """``residual + (x W^T + bias + (x A^T) (s · B)^T)`` for a :class:`LoraWeight`, each product by ``linear``
    (the ops' own: plain torch, fp8 for an fp8 base, batch-invariant), the adapter's output added to the
    base's as the trainer adds it; any other weight goes to ``linear`` as it is."""
    if not isinstance(weight, LoraWeight):
        return linear(x, weight, bias, residual)
    y = linear(x, weight.base, bias)
    y = y + linear(linear(x, weight.a), weight.b)
    return y if residual is None else residual + y


__all__ = ["LoraWeight", "lora_linear", "merged_weight", "scaled_b"]
