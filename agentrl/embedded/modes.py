"""How the embedded engine's runner runs its forward: the mode decisions, made once, in one place.

The engine's switches (``cuda_graphs``, ``compile``, ``batch_invariant``, ``quantization``) do not act
alone: batch-invariant kernels rule out compilation and the packed prefill kernel, fp8 brings its own
ops, a mixture-of-experts model keeps CUDA graphs only where its experts run without host syncs, and
prefill graphs need packed prefill, graphs and a dense model. :func:`resolve_modes` decides them all from
the switches, the model and the device, and answers a :class:`RunnerModes`, which
:class:`~agentrl.embedded.runner.ModelRunner` starts from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from agentrl.embedded import fp8
from agentrl.models.decoder import (
    BATCH_INVARIANT_OPS,
    TORCH_OPS,
    DecoderOps,
    ExpertsKernel,
    experts_sorted,
)
from agentrl.models.moe import MoESpec


@dataclass(frozen=True)
class RunnerModes:
    """The runner's mode decisions (see the module docstring)."""

    # every op of agentrl.batch_invariant, so a row's bits depend on nothing but its own tokens (not the
    # batch, its position in it, the prefill chunking or a prefix hit), as the trainer's true on-policy
    # forward runs it
    batch_invariant: bool
    # "fp8": the projections served from fp8 copies of the parameters (agentrl.embedded.fp8)
    quantization: str | None
    # the layer's ops (agentrl.models.decoder) the runner starts with: plain torch, agentrl.batch_invariant's
    # or fp8's, with graph-capturable experts for a mixture-of-experts model under CUDA graphs
    ops: DecoderOps
    # decode (and packed prefill) steps replay captured CUDA graphs
    cuda_graphs: bool
    # torch.compile fuses each layer's element-wise work (norms, RoPE, softmax, SiLU): a decode step is
    # otherwise ~45 small kernels per layer, which even a CUDA graph replays at a few microseconds each
    compiled: bool
    # the MLP compiled too (a mixture-of-experts MLP runs eagerly)
    compiled_mlp: bool
    # prefill packs the step's tokens end to end and reads attention straight from the slot cache
    # (agentrl.embedded.attention); otherwise a padded rectangle through torch SDPA
    packed_prefill: bool
    # packed prefill steps of a token bucket replay a captured graph (MoE: grouped GEMMs sync on sizes)
    prefill_graphs: bool
    # decode attention: torch SDPA on CPU (fused there), two batched matmuls over the cached keys and
    # values on a GPU (graph-captured and compiled with the rest of the step)
    decode_attention: Literal["sdpa", "matmul"]


def resolve_modes(
    device: torch.device,
    head_dim: int,
    moe: MoESpec | None,
    rope_type: str,
    *,
    cuda_graphs: bool,
    compile: bool,
    batch_invariant: bool,
    quantization: str | None,
) -> RunnerModes:
    """The modes a runner of a model (``head_dim``, ``moe``: its MoE shape or None, ``rope_type``: its
    RoPE variant) runs in on ``device`` under the engine's switches; raises ValueError for a mode the model
    cannot run in."""
    on_gpu = device.type == "cuda"
    if batch_invariant and rope_type != "default":
        raise ValueError(f"batch-invariant mode serves plain RoPE only, not {rope_type!r}")
    if moe is not None and batch_invariant:
        raise ValueError("batch-invariant mode serves dense models only, not mixture-of-experts models")
    graphs = cuda_graphs and on_gpu
    ops = _ops(batch_invariant, quantization)
    if moe is not None:
        experts = _graph_experts(device, quantization)
        graphs = graphs and experts is not None  # else eager experts, no graphs
        if graphs:
            ops = replace(ops, experts=experts)
    from agentrl.embedded import attention as packed_attention  # Triton, where installed

    packed_prefill = on_gpu and not batch_invariant and packed_attention.available(head_dim)
    compiled = compile and on_gpu and not batch_invariant
    return RunnerModes(
        batch_invariant=batch_invariant,
        quantization=quantization,
        ops=ops,
        cuda_graphs=graphs,
        compiled=compiled,
        compiled_mlp=compiled and moe is None,
        packed_prefill=packed_prefill,
        prefill_graphs=packed_prefill and graphs and moe is None,
        decode_attention="sdpa" if device.type == "cpu" else "matmul",
    )


def _ops(batch_invariant: bool, quantization: str | None) -> DecoderOps:
    """The layer's ops: plain torch, agentrl.batch_invariant's, or fp8's (which exclude batch invariance)."""
    if quantization == "fp8":
        return fp8.FP8_OPS
    return BATCH_INVARIANT_OPS if batch_invariant else TORCH_OPS


def _graph_experts(device: torch.device, quantization: str | None) -> ExpertsKernel | None:
    """The experts kernel CUDA graphs can capture (no host syncs: grouped GEMMs over expert-sorted rows;
    fp8: torch._scaled_grouped_mm where torch has it for the GPU), or None where there is none."""
    if quantization is not None:
        return fp8.sorted_experts(device)
    return experts_sorted if hasattr(torch, "_grouped_mm") else None


__all__ = ["RunnerModes", "resolve_modes"]
