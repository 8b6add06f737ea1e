"""The one place where agentrl bends megatron-core: so that it runs on CPU (gloo) as well as on GPU, and
so that torch.compile sees whole transformer layers.

megatron-core is written for CUDA. The parts agentrl uses (``GPTModel`` with the local layer spec,
tensor-parallel linears/embeddings, ``parallel_state``) run unchanged on CPU except for these spots, and
:func:`apply_cpu_patches` handles exactly them. It is a no-op when CUDA is available, and idempotent.

1. ``torch.cuda.current_device()`` is used as the *device* of freshly allocated tensors in the
   tensor-parallel layers (all-gather / reduce-scatter output buffers in
   ``tensor_parallel.mappings``), the rotary embedding, the global memory buffer and a few inits. On a
   machine without CUDA the call raises. The patch makes it return ``"cpu"`` there, so those
   allocations land on the CPU, where gloo expects them. Nothing else in torch calls
   ``current_device()`` on a CUDA-less machine, so the patch cannot mask a real CUDA bug.

2. Megatron's default core attention (``DotProductAttention``) preallocates its score matrix from the
   CUDA-only global memory buffer and runs dropout inside the CUDA RNG tracker. agentrl does not patch
   it: the layer spec swaps in :class:`agentrl.trainer.attention.SDPACoreAttention` (torch SDPA, causal,
   GQA), which is also the faster kernel on GPU. Mentioned here so that the whole story is in one place.

3. ``model_parallel_cuda_manual_seed`` (the CUDA RNG tracker) is never called on CPU: dropout is 0
   and weights are loaded from checkpoints, so the tracker is not needed there (see ``trainer.py``).

What is *not* patched, and therefore stays GPU-only: megatron's ``DistributedDataParallel`` and
distributed optimizer (CUDA streams and buffers) and the pipeline schedules (they allocate with
``device="cuda"`` literally). On CPU the trainer uses a plain ``torch.optim.AdamW`` with an explicit
data-parallel gradient all-reduce and its own micro-batch loop (pipeline size 1).

4. For ``compile_layers`` only (:func:`quiet_default_tp_group`): megatron's ``RowParallelLinear`` passes
   ``tp_group=None`` to its linear op on every call, and the op's lookup of the default group then
   issues a ``DeprecationWarning`` on rank 0. torch.compile cannot trace that call (its category argument
   is a class), so it split every layer into several graphs there. The patch looks the group up the same
   way, without the warning.

5. Mixture-of-experts models (:func:`apply_moe_patches`): the router's gate reads a Transformer Engine
   name that is unbound without TE. The MoE layer uses the ``allgather`` token dispatcher, the one that
   allocates no CUDA stream (see :mod:`agentrl.trainer.moe`).

6. Loading (:func:`import_megatron`): megatron-core decorates its fused kernels (bias-GeLU, GeGLU,
   SwiGLU, the MoE router's expert-bias update...) with ``torch.compile`` as its modules load, and that
   decoration loads inductor's code generators: 1-2 CPU-seconds in every trainer process. The trainer
   loads megatron-core with those decorations left out when it compiles no kernels (``compile_kernels``
   off, the CPU default): the kernels run as the plain torch code they are written in, and a MoE step on
   the CPU no longer traces the router's update with dynamo. With ``compile_kernels`` on, megatron-core
   loads as it is. Either way the first load of the process decides: a process that imported
   megatron-core before its first trainer keeps megatron's own decorations.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

_APPLIED = False


def _cpu_current_device() -> str:
    return "cpu"


def apply_cpu_patches() -> bool:
    """Apply the CPU patches when CUDA is unavailable; returns whether they are active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if not _APPLIED:
        torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
        _APPLIED = True
    return True


def quiet_default_tp_group() -> None:
    """Make the tensor-parallel layers' default-group lookup silent (point 4 above); idempotent."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    def lookup(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
        if not torch.distributed.is_initialized():
            return None
        if tp_group is not None or not parallel_state.is_initialized():
            return tp_group
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    layers.get_tensor_model_parallel_group_if_none = lookup


def apply_moe_patches() -> None:
    """megatron-core's router gate (``RouterGatingLinearFunction``) reads ``te_general_gemm``, a name its
    module binds only when Transformer Engine imports; without TE the read is a ``NameError``. Bind it to
    None there, which selects the plain ``torch.mm`` branch the function already has. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def import_megatron(compile_kernels: bool) -> None:
    """Load megatron-core (point 6 above): its fused kernels compiled by ``torch.compile`` only with
    ``compile_kernels``. The kernels are decorated once per process, as megatron-core first loads: where
    it is loaded already (by a trainer built before, or by the caller's own import), they stay as that
    load made them and this is a no-op."""
    if compile_kernels or "megatron.core.jit" in sys.modules:
        import megatron.core.jit

        return
    real = torch.compile
    torch.compile = _plain  # type: ignore[assignment]
    try:  # megatron.core.jit binds its jit_fuser to torch.compile as it loads
        import megatron.core.jit  # noqa: F401
    finally:
        torch.compile = real  # type: ignore[assignment]


def _plain(model: Any = None, **options: Any) -> Any:
    """``torch.compile``'s signature, compiling nothing: the function itself (or, called with options
    only, a decorator that returns it)."""
    return (lambda fn: fn) if model is None else model
