"""Grouped-GEMM experts for megatron-core's ``MoELayer``: every local expert's SwiGLU weights stacked in
two tensors and run with one ``torch._grouped_mm`` per projection, without Transformer Engine or the
``grouped_gemm`` package that megatron-core's own grouped modules need.

:class:`GroupedExperts` has ``SequentialMLP``'s forward contract (``(permuted_local_hidden_states,
tokens_per_expert, permuted_probs) -> (output, None)``, the rows sorted by local expert) and its math: per
expert ``fc2(silu(gate) * up * prob)``, the router's prob applied after the activation. Weights, per
local expert ``j`` (what ``local_experts.{j}.linear_fc1/linear_fc2.weight`` hold in ``SequentialMLP``):

- ``fc1_weight`` ``[E_local, 2*ffn/tp, hidden]``: ``[gate_t; up_t]`` of expert-TP rank ``t``;
- ``fc2_weight`` ``[E_local, hidden, ffn/tp]``.

The grouped kernel runs on CUDA in bf16 (``torch._grouped_mm`` wants sm90 and 16-byte aligned rows); any
other case (CPU, fp32) loops over the experts with one matmul pair each on the same stacked weights, which
is exactly ``SequentialMLP``'s arithmetic. No communication happens here: with expert parallelism or
expert tensor parallelism the token dispatcher gathers and reduces around the experts, as it does for
megatron's own expert modules (their linears skip their TP collectives for experts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run ``x`` against ``weights`` here: CUDA sm90+, bf16, and every
    row of every operand a multiple of 16 bytes (the kernel's alignment)."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(w.dtype == torch.bfloat16 and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0 for w in weights)


class GroupedExperts(MegatronModule):
    """A rank's local SwiGLU experts with stacked weights (see the module docstring). Built by
    megatron's ``MoELayer`` from a ``ModuleSpec`` as ``GroupedExperts(num_local_experts, config, ...)``;
    the process groups megatron passes are not needed (no communication here)."""

    def __init__(self, num_local_experts: int, config: Any, submodules: Any = None, **_groups: Any) -> None:
        super().__init__(config=config)
        if not config.gated_linear_unit or config.activation_func is not F.silu or config.add_bias_linear:
            raise ValueError("GroupedExperts runs SwiGLU experts without biases only")
        self.num_local_experts = num_local_experts
        tp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
        ffn = config.moe_ffn_hidden_size
        if ffn % tp:
            raise ValueError(
                f"moe_ffn_hidden_size {ffn} does not split over expert tensor parallel size {tp}"
            )
        h, f = config.hidden_size, ffn // tp
        dtype = config.params_dtype
        self.fc1_weight = torch.nn.Parameter(torch.empty(num_local_experts, 2 * f, h, dtype=dtype))
        self.fc2_weight = torch.nn.Parameter(torch.empty(num_local_experts, h, f, dtype=dtype))
        expert_parallel = config.expert_model_parallel_size > 1
        for w, dim in ((self.fc1_weight, 1), (self.fc2_weight, 2)):
            set_tensor_model_parallel_attributes(w, is_parallel=True, dim=dim, stride=1)
            # megatron's mark for expert weights: reduced over the expert-data-parallel group only
            w.allreduce = not expert_parallel
        if config.perform_initialization:
            with torch.no_grad():
                for w in (self.fc1_weight, self.fc2_weight):
                    torch.nn.init.normal_(w, std=config.init_method_std)

    def _activation(self, fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` weighted by each row's prob, as megatron's MLP does for an expert."""
        if self.config.bias_activation_fusion:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(fc1, None, probs.unsqueeze(-1))
        gate, up = torch.chunk(fc1, 2, dim=-1)
        return (F.silu(gate) * up * probs.unsqueeze(-1)).to(fc1.dtype)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """Rows sorted by local expert (``tokens_per_expert[j]`` rows for expert ``j``) -> their outputs."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # top-1 only: the prob scales the input instead
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        if x.shape[0] > 0 and grouped_mm_supported(x, self.fc1_weight, self.fc2_weight):
            offs = torch.cumsum(tokens_per_expert.to(device=x.device), dim=0, dtype=torch.int32)
            fc1 = torch._grouped_mm(x, self.fc1_weight.transpose(-2, -1), offs=offs)
            out = torch._grouped_mm(
                self._activation(fc1, probs), self.fc2_weight.transpose(-2, -1), offs=offs
            )
            return out, None
        counts = tokens_per_expert.tolist()
        outs = []
        for j, (rows, p) in enumerate(zip(torch.split(x, counts), torch.split(probs, counts), strict=True)):
            fc1 = F.linear(rows, self.fc1_weight[j])
            outs.append(F.linear(self._activation(fc1, p), self.fc2_weight[j]))
        return torch.cat(outs, dim=0), None

    def backward_dw(self) -> None:
        """Nothing deferred: weight gradients come with the backward pass (megatron's MoELayer may call
        it)."""


__all__ = ["GroupedExperts", "grouped_mm_supported"]
