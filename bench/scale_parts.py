"""A scale model of one RL step past one host: step time and weight-sync time from per-GPU figures.

An RL step has four parts, each modelled from a figure measured on one or two GPUs (or a vendor
spec where nothing was measured), and composed per placement:

- **rollout**: generated tokens / (engines x one engine's tokens/s). A decode step of ``c`` rows
  has a device part, the larger of reading the bytes it touches (weights, or for a mixture of experts
  the experts its rows reach, plus every row's KV cache) at the engine's share of HBM bandwidth and
  its matmul FLOPs at a share of peak, and a host part, a fixed cost and a cost per row. The embedded
  engine runs the two one after the other; SGLang prepares the next step on the host while the device
  runs this one (its overlap scheduler), so its step is the larger of the two, and its device part
  adds a share of the smaller of reads and matmuls to the larger. Prompts prefill at a share of peak.
- **training**: 6 x active parameters x tokens (plus causal attention) / (GPUs x MFU x peak), then
  the data-parallel gradient reduce-scatter and parameter all-gather and, for experts spread over a
  host, the all-to-all of each token's hidden state to its experts and back. For the measured 7B steps,
  tensor parallelism adds the activations' all-reduces, and CPU Adam the gradients out, the weights
  back and the host's Adam step.
- **weight sync**: bytes / bandwidth, plus fixed costs and costs per HF tensor: colocated in memory
  (CUDA IPC, HBM copies), broadcast over NVLink in a host, or over the network between hosts (NCCL
  from trainer rank 0, a broadcast a tensor: one NIC's bandwidth, however many engines listen), with
  SGLang's receiving side (a cost a GB, and one an expert tensor) on top.
- **hand-overs** (colocated only): the trainer's state to host memory and back, the engine's
  weights saved and restored, the KV pool released and mapped again.

Placements: colocated (every GPU generates, then trains, in turns), disaggregated with the rollout
waiting for the trainer (no overlap), and disaggregated one-step off-policy (the platform's async
mode: the engines generate batch k+1 while the trainer trains on batch k; the step is the longer of
the two plus the sync, which pauses both).

Every input sits in :class:`ScaleInputs` with its kind (measured, fit, vendor, assumption) and its
source. The measured points it is checked against are in bench/scale_points.py; ``python
bench/scale_model.py`` prints the predictions and the check. Why each part is shaped as it is, and what
the predictions say: docs/design/scale-model.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

GB = 1e9


def _fig(value: float, kind: str, source: str) -> Any:
    """A dataclass field holding one input with where it comes from."""
    return field(default=value, metadata={"kind": kind, "source": source})


_ENGINE_FIT = "embedded engine, 0.5B and 7B shapes at 64 and 256 in flight, 1x H200, b8a69bd and 30f3000"
_SGLANG_FIT = (
    "SGLang, 0.5B shape at 64 and 256 in flight (185b92d, 1x H100) and 1B MoE at 64 and 256 (30f3000, "
    "1x H200): steps host-bound at 4.2-9.4 ms where the device part is 0.4-0.9 ms"
)
_IPC_FIT = "in-memory syncs, SmolLM2 0.047 s (e8793d1) and the 0.5B shape 0.050 s (1d1fbc2), 1x H100"
_SGLANG_7B_FIT = (
    "SGLang's 7B decode step and prefill at 16 and 256 rows (bench/engine_throughput.py --split: prompts "
    "of 512 tokens, 1,024 new), c436473, 1x H200"
)
_SGLANG_RECEIVE_FIT = (
    "SGLang's NCCL receiving side: its push less the bench receiver's in the same run, 0.5B shape "
    "(0.99 GB, +6.7 ms) and 7B (15.2 GB, +66.3 ms), bench/weight_broadcast.py, c436473, 2x H200"
)
_KV_FIT = "one engine's KV pool, 1x H200 of a 4x host, a269f59 (multi-gpu.md)"
_SGLANG_IPC_FIT = (
    "SGLang's in-memory syncs in whole steps: 7B from a TP2 trainer 0.398 s (15.2 GB, 339 tensors, 77005c6, "
    "2x H200), 12 of 30B-A3B's layers from an EP2 trainer 1.912 s (16.2 GB, 4,719 tensors, 4,608 of them "
    "experts, 05ba71c, 2x H200), 14 of 7B's layers from a one-GPU trainer 0.112 s (8.7 GB, 171 tensors, "
    "3bdc701, 1x H200) and the whole 3B shape from one 0.1245 s (6.2 GB, 434 tensors, 36c8cd8, 1x H200)"
)


@dataclass(frozen=True)
class ScaleInputs:
    """Every number the model uses. ``kind``: measured (commit, GPU), fit (to measured points, named),
    vendor (a datasheet), assumption (nothing measured; the doc says what would change it)."""

    # The GPU (H100 SXM and H200 share the compute; H200 has more and faster memory)
    peak_flops: float = _fig(989e12, "vendor", "NVIDIA H100/H200 SXM datasheet: dense BF16 989 TFLOPS")
    hbm_bytes_per_s: float = _fig(4.8e12, "vendor", "NVIDIA H200 datasheet: HBM3e 4.8 TB/s")
    gpu_memory: float = _fig(141 * GB, "vendor", "NVIDIA H200 datasheet: 141 GB")
    gpus_per_host: int = _fig(8, "vendor", "HGX/DGX H200: 8 GPUs a host")
    nvlink_bytes_per_s: float = _fig(450 * GB, "vendor", "NVLink 4: 900 GB/s a GPU, both directions")
    nic_bytes_per_s: float = _fig(
        50 * GB, "vendor", "ConnectX-7 NDR InfiniBand / 400GbE RoCE: 400 Gb/s a GPU"
    )
    pcie_bytes_per_s: float = _fig(64 * GB, "vendor", "PCIe Gen5 x16: 64 GB/s each direction")
    # Links as NCCL drives them
    nvlink_allreduce_bus: float = _fig(
        319 * GB, "measured", "NCCL all-reduce bus bandwidth, 1 GiB, 2x H200, e3f220d (multi-gpu.md)"
    )
    nvlink_broadcast: float = _fig(
        367 * GB, "measured", "NCCL broadcast 1 GiB, 2x H200, e3f220d (multi-gpu.md)"
    )
    nic_efficiency: float = _fig(
        0.8, "assumption", "share of a NIC's line rate NCCL reaches (ring, no SHARP)"
    )
    # One engine (embedded engine, bf16)
    engine_step_fixed_s: float = _fig(1.36e-3, "fit", _ENGINE_FIT + ": fixed cost a decode step")
    engine_row_s: float = _fig(28.0e-6, "fit", _ENGINE_FIT + ": host cost a row a decode step")
    engine_hbm_efficiency: float = _fig(0.7, "fit", _ENGINE_FIT + ": share of HBM bandwidth read")
    engine_flops_efficiency: float = _fig(0.3, "fit", _ENGINE_FIT + ": share of peak in decode matmuls")
    prefill_flops_efficiency: float = _fig(0.644, "fit", _SGLANG_7B_FIT + ": prefill matmuls' share of peak")
    # SGLang engines: their own device efficiency and host costs, the host part overlapped with the device
    sglang_hbm_efficiency: float = _fig(0.657, "fit", _SGLANG_7B_FIT + ": share of HBM bandwidth read")
    sglang_exposed: float = _fig(
        0.253, "fit", _SGLANG_7B_FIT + ": share of the smaller of reads and matmuls not hidden by the larger"
    )
    sglang_step_fixed_s: float = _fig(3.2e-3, "fit", _SGLANG_FIT + ": host cost a decode step")
    sglang_row_s: float = _fig(22.4e-6, "fit", _SGLANG_FIT + ": host cost a row a decode step")
    # The trainer
    mfu_dense: float = _fig(
        0.385, "measured", "update MFU, Qwen2.5-0.5B shape, micro-batch 32, 1x H100, ed9a9bf"
    )
    mfu_dense_7b: float = _fig(
        0.487,
        "fit",
        "the trainer's rate in the colocated 7B step: Qwen2.5-7B shape at TP2, 10,515 tok/s a GPU, "
        "77005c6, 2x H200",
    )
    mfu_moe: float = _fig(
        0.20,
        "assumption",
        "grouped expert GEMMs are not measured on a GPU (1.1% with SequentialMLP, d547cdf)",
    )
    rl_step_over_update: float = _fig(0.9, "measured", "RL step / update alone 0.88-0.91, 1x H100, ed9a9bf")
    grad_bytes: float = _fig(4, "assumption", "agentrl.trainer.optim: grads reduced in fp32")
    optimizer_bytes: float = _fig(12, "assumption", "fp32 main weights + two Adam moments, sharded over DP")
    activation_reserve: float = _fig(25 * GB, "assumption", "a trainer rank's activations and workspace")
    cpu_adam_params_per_s: float = _fig(
        1.0e9,
        "assumption",
        "CPU Adam (trainer.optimizer_cpu_offload), not measured apart: torch's AdamW on a host's cores, "
        "some 80 bytes of fp32 passes a parameter at about 80 GB/s of host memory bandwidth",
    )
    # Weight sync
    push_tensor_s: float = _fig(
        60.8e-6,
        "fit",
        "NCCL pushes to bench/weight_broadcast.py's receiver, a broadcast a tensor: 0.5B shape (290 "
        "tensors), 7B (339) and 12 of 30B-A3B's layers (4,719), c436473, 2x H200",
    )
    ipc_fixed_s: float = _fig(0.0207, "fit", _IPC_FIT + ": fixed cost a sync")
    tensor_s: float = _fig(95e-6, "fit", _IPC_FIT + ": a HF tensor's naming, packing and copy")
    ipc_copy_passes: float = _fig(6, "assumption", "gather, pack, copy in place: each a read and a write")
    ipc_assembly_s_per_gb: float = _fig(
        27.85e-3,
        "fit",
        _SGLANG_IPC_FIT + ": assembling an engine's shard from a split trainer, a GB gathered",
    )
    sglang_ipc_s_per_gb: float = _fig(8.08e-3, "fit", _SGLANG_IPC_FIT + ": packing and loading, a GB")
    sglang_ipc_tensor_s: float = _fig(
        124.2e-6, "fit", _SGLANG_IPC_FIT + ": packing and loading, a tensor outside the experts"
    )
    sglang_ipc_expert_tensor_s: float = _fig(
        330.1e-6, "fit", _SGLANG_IPC_FIT + ": packing and loading, an expert's tensor"
    )
    sglang_receive_fixed_s: float = _fig(2.57e-3, "fit", _SGLANG_RECEIVE_FIT + ": fixed cost a sync")
    sglang_receive_s_per_gb: float = _fig(4.18e-3, "fit", _SGLANG_RECEIVE_FIT + ": a GB received")
    sglang_receive_expert_tensor_s: float = _fig(
        111e-6,
        "fit",
        "SGLang's receiving side of 12 of 30B-A3B's layers (16.2 GB, 4,719 tensors, 4,608 of them experts): "
        "+0.58 s over the bench's receiver where bytes give 0.07, c436473, 2x H200: a cost an expert tensor",
    )
    pause_s: float = _fig(0.05, "assumption", "pausing generation and resubmitting around a sync")
    # Colocated hand-overs
    host_copy_bytes_per_s: float = _fig(
        33 * GB, "fit", "trainer offload 0.073 s of 18 B x 134.5M, 1x H200, a269f59 (multi-gpu.md)"
    )
    kv_release_fixed_s: float = _fig(0.0157, "fit", _KV_FIT + ": release 0.034 s (27.6 GB), 0.076 s (91 GB)")
    kv_release_s_per_gb: float = _fig(0.66e-3, "fit", _KV_FIT + ": the same two releases")
    kv_resume_fixed_s: float = _fig(0.0024, "fit", _KV_FIT + ": resume 0.015 s (27.6 GB), 0.044 s (91 GB)")
    kv_resume_s_per_gb: float = _fig(0.457e-3, "fit", _KV_FIT + ": the same two resumes")
    engine_weights_backup: bool = _fig(True, "assumption", "engine weights saved to host on release")

    def table(self) -> list[dict[str, Any]]:
        """The inputs as rows: name, value, kind, source."""
        return [
            {"name": f.name, "value": getattr(self, f.name), **f.metadata} for f in dataclasses.fields(self)
        ]


@dataclass(frozen=True)
class Shape:
    """A decoder's size as the model needs it (bf16 weights)."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width; 0 for a mixture of experts
    vocab: int
    tied: bool
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    qk_norm: bool = False
    qkv_bias: bool = False

    def _attn_params(self) -> int:
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return self.hidden * (q + 2 * kv) + q * self.hidden + bias

    def _expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        mlp = self.experts * self._expert_params() + self.experts * self.hidden if self.experts else 0
        mlp = mlp or 3 * self.hidden * self.intermediate
        return self.layers * (self._attn_params() + mlp) + self.embed_params

    @property
    def active_matmul_params(self) -> int:
        """Parameters a token multiplies through (experts: its top-k; the LM head included)."""
        mlp = self.top_k * self._expert_params() if self.experts else 3 * self.hidden * self.intermediate
        return self.layers * (self._attn_params() + mlp) + self.vocab * self.hidden

    @property
    def hf_tensors(self) -> int:
        """Tensors in the HF checkpoint: what a sync names, one by one."""
        attn = 4 + (3 if self.qkv_bias else 0) + (2 if self.qk_norm else 0)
        mlp = 3 * self.experts + 1 if self.experts else 3
        return self.layers * (attn + mlp + 2) + 1 + (1 if self.tied else 2)

    @property
    def expert_tensors(self) -> int:
        """The checkpoint's expert tensors: gate, up and down projections, one tensor an expert."""
        return self.layers * self.experts * 3

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2

    def weight_bytes_touched(self, rows: int) -> float:
        """Bytes one decode step of ``rows`` rows reads: all dense weights, and of the experts the ones
        its rows reach (routing taken as uniform)."""
        if not self.experts:
            return 2.0 * self.params
        reached = self.experts * (1 - (1 - self.top_k / self.experts) ** rows)
        dense = self.params - self.layers * self.experts * self._expert_params()
        return 2.0 * (dense + self.layers * reached * self._expert_params())


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in [
        Shape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, True),
        Shape("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, True, qkv_bias=True),
        Shape("qwen3-moe-1b", 20, 1024, 16, 4, 64, 0, 151936, True, 16, 2, 768, qk_norm=True),
        Shape("qwen2.5-1.5b", 28, 1536, 12, 2, 128, 8960, 151936, True, qkv_bias=True),
        Shape("qwen2.5-3b", 36, 2048, 16, 2, 128, 11008, 151936, True, qkv_bias=True),
        Shape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, False, qkv_bias=True),
        Shape("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 0, 151936, False, 128, 8, 768, qk_norm=True),
        Shape("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 0, 151936, False, 128, 8, 1536, qk_norm=True),
    ]
}


@dataclass(frozen=True)
class Workload:
    """What one step generates and trains: the 7B step's planned workload (prompts of 512 tokens, responses to
    1,024, 32 groups of 8 on 4 GPUs). By default the batch a GPU stays fixed as GPUs are added (weak
    scaling, as the measured DP runs did); ``trajectories`` fixes the whole step's batch instead."""

    trajectories_per_gpu: int = 64
    trajectories: int | None = None
    prompt_tokens: int = 512
    response_tokens: int = 1024  # random weights seldom stop early: responses run to the cap

    def batch(self, gpus: int) -> int:
        return self.trajectories if self.trajectories is not None else self.trajectories_per_gpu * gpus


# --- the parts -----------------------------------------------------------------------------------


ENGINES = ("sglang", "embedded")


def _engine(engine: str) -> str:
    """``engine``, one of :data:`ENGINES` (else ValueError)."""
    if engine not in ENGINES:
        raise ValueError(f"engine: one of {ENGINES}, not {engine!r}")
    return engine


def decode_step_s(
    shape: Shape, rows: int, context: float, gpus: int, inp: ScaleInputs, engine: str = "sglang"
) -> float:
    """One decode step of an engine spread over ``gpus`` GPUs with ``rows`` rows of ``context`` tokens:
    its device part and its host part, after one another in the embedded engine, overlapped in SGLang.
    The device part is the larger of reads and matmuls; in SGLang (measured over 16-256 rows at 7B) a
    share of the smaller stays outside it."""
    read = shape.weight_bytes_touched(rows) + rows * context * shape.kv_bytes_per_token
    sglang = _engine(engine) == "sglang"
    hbm = inp.sglang_hbm_efficiency if sglang else inp.engine_hbm_efficiency
    memory = read / (gpus * inp.hbm_bytes_per_s * hbm)
    compute = rows * 2 * shape.active_matmul_params / (gpus * inp.peak_flops * inp.engine_flops_efficiency)
    if not sglang:
        return inp.engine_step_fixed_s + rows * inp.engine_row_s + max(memory, compute)
    device = max(memory, compute) + inp.sglang_exposed * min(memory, compute)
    return max(inp.sglang_step_fixed_s + rows * inp.sglang_row_s, device)


def engine_tokens_per_s(
    shape: Shape, rows: int, context: float, gpus: int, inp: ScaleInputs, engine: str = "sglang"
) -> float:
    """One engine's decode tokens/s at ``rows`` in flight."""
    return rows / decode_step_s(shape, rows, context, gpus, inp, engine)


def prefill_s(shape: Shape, rows: int, prompt_tokens: int, gpus: int, inp: ScaleInputs) -> float:
    """Prefilling ``rows`` prompts of ``prompt_tokens`` on an engine over ``gpus`` GPUs."""
    flops = rows * prompt_tokens * 2 * shape.active_matmul_params
    return flops / (gpus * inp.peak_flops * inp.prefill_flops_efficiency)


def rollout_s(
    shape: Shape,
    trajectories: int,
    engines: int,
    engine_gpus: int,
    w: Workload,
    inp: ScaleInputs,
    engine: str = "sglang",
) -> float:
    """Generating a batch: every engine prefills its prompts, then decodes its rows to the cap."""
    rows = math.ceil(trajectories / engines)
    prefill = prefill_s(shape, rows, w.prompt_tokens, engine_gpus, inp)
    context = w.prompt_tokens + w.response_tokens / 2
    decode = w.response_tokens * rows / engine_tokens_per_s(shape, rows, context, engine_gpus, inp, engine)
    return prefill + decode


def dense_mfu(shape: Shape, inp: ScaleInputs) -> float:
    """A dense model's training MFU: that of the measured width nearer ``shape``'s on a log scale, the
    0.5B shape's 896 or the 7B shape's 3,584 (wider matmuls run nearer peak)."""
    narrow, wide = SHAPES["qwen2.5-0.5b"].hidden, SHAPES["qwen2.5-7b"].hidden
    return inp.mfu_dense_7b if shape.hidden >= math.sqrt(narrow * wide) else inp.mfu_dense


def train_flops_per_token(shape: Shape, seq: float) -> float:
    return 6 * shape.active_matmul_params + 6 * shape.layers * shape.q_heads * shape.head_dim * seq


def model_parallel(shape: Shape, gpus: int, inp: ScaleInputs) -> int | None:
    """The fewest GPUs one copy of the trainer's model is split over (experts, then pipeline stages)
    so that a rank's weights, gradients, optimizer shard and activations fit; None if none does."""
    state = (2 + inp.grad_bytes) * shape.params
    m = 1
    while m <= gpus:
        if state / m + inp.optimizer_bytes * shape.params / gpus + inp.activation_reserve <= inp.gpu_memory:
            return m
        m *= 2
    return None


def allreduce_bus(gpus: int, inp: ScaleInputs) -> float:
    """A collective's bus bandwidth a GPU over ``gpus`` GPUs: NVLink within a host, its NIC across hosts."""
    return inp.nvlink_allreduce_bus if gpus <= inp.gpus_per_host else _nic(inp)


def _nic(inp: ScaleInputs) -> float:
    return inp.nic_bytes_per_s * inp.nic_efficiency


def train_s(
    shape: Shape,
    tokens: float,
    gpus: int,
    seq: float,
    inp: ScaleInputs,
    tp: int = 1,
    cpu_adam: bool = False,
) -> dict[str, float]:
    """A trainer step on ``gpus`` GPUs: compute, data-parallel collectives, expert all-to-all. ``tp``: a
    model copy split over ``tp`` GPUs by tensor parallelism instead of the layout :func:`model_parallel`
    picks (the same MFU, plus two all-reduces of the activations a layer forward and two backward).
    ``cpu_adam``: Adam's state and step on the host (``trainer.optimizer_cpu_offload``): each rank's fp32
    gradient shard out and bf16 weights back at the host-copy rate, and the step at a host's CPU Adam rate."""
    mfu = inp.mfu_moe if shape.experts else dense_mfu(shape, inp)
    compute = (
        tokens * train_flops_per_token(shape, seq) / (gpus * mfu * inp.peak_flops * inp.rl_step_over_update)
    )
    on_gpu = dataclasses.replace(inp, optimizer_bytes=0) if cpu_adam else inp
    m = tp if tp > 1 else model_parallel(shape, gpus, on_gpu) or gpus
    dp = gpus // m
    # reduce-scatter of fp32 gradients and all-gather of bf16 weights over the data-parallel group
    dp_bytes = (inp.grad_bytes + 2) * shape.params / m * (dp - 1) / max(dp, 1)
    collectives = dp_bytes / allreduce_bus(gpus, inp) if dp > 1 else 0.0
    all_to_all = 0.0
    if shape.experts:
        ep = min(m, inp.gpus_per_host, shape.experts)
        # dispatch and combine, forward and backward: 4 x top-k copies of a token's hidden state a layer
        per_token = 4 * shape.top_k * shape.hidden * 2 * shape.layers * (ep - 1) / ep
        all_to_all = tokens / gpus * per_token / inp.nvlink_allreduce_bus
    # an all-reduce of a [tokens x hidden] bf16 activation: 2 (tp - 1) / tp of it over the bus
    activations = 4 * shape.layers * tokens / dp * shape.hidden * 2
    tensor_parallel = activations * 2 * (tp - 1) / tp / inp.nvlink_allreduce_bus
    host_adam = 0.0
    if cpu_adam:
        shard = shape.params / gpus  # the distributed optimizer's shard a rank
        host = shape.params * min(gpus, inp.gpus_per_host) / gpus  # a host's ranks share its cores
        copies = (inp.grad_bytes + 2) * shard / inp.host_copy_bytes_per_s
        host_adam = copies + host / inp.cpu_adam_params_per_s
    return {
        "compute": compute,
        "collectives": collectives,
        "all_to_all": all_to_all,
        "tensor_parallel": tensor_parallel,
        "host_adam": host_adam,
    }


def sync_s(
    shape: Shape,
    transport: str,
    inp: ScaleInputs,
    trainer_split: int = 1,
    engine_gpus: int = 1,
    gbytes: float | None = None,
    engine: str = "sglang",
) -> float:
    """One weight sync. ``transport``: ipc (colocated: each GPU's engine shard assembled from the
    trainer ranks holding it, over NVLink in a host and the NICs beyond, then copied in place by the
    embedded engine, or packed and loaded tensor by tensor by SGLang, at its own costs), nvlink
    (NCCL broadcast from trainer rank 0 in a host), network (the same between hosts: one NIC's
    bandwidth, pipelined however many engines listen), bench (the NCCL push alone, as
    bench/weight_broadcast.py times it: no naming of tensors). A push is a broadcast a tensor. Over
    NCCL, SGLang's receiving side (a request a bucket, each tensor loaded into its model, an expert's
    at a cost of its own) adds to the embedded engine's.
    ``trainer_split``: the GPUs one copy of the trainer's weights is split over."""
    nbytes = gbytes * GB if gbytes is not None else 2.0 * shape.params
    per_tensor = shape.hf_tensors * inp.tensor_s
    sglang = _engine(engine) == "sglang"
    if transport == "ipc":
        shard, m = nbytes / engine_gpus, trainer_split
        in_host = shard * (min(m, inp.gpus_per_host) - 1) / m / GB * inp.ipc_assembly_s_per_gb
        across = shard * max(m - inp.gpus_per_host, 0) / m / _nic(inp)
        if sglang:
            load = (
                shard / GB * inp.sglang_ipc_s_per_gb + shape.expert_tensors * inp.sglang_ipc_expert_tensor_s
            )
            load += (shape.hf_tensors - shape.expert_tensors) * inp.sglang_ipc_tensor_s
        else:
            load = per_tensor + inp.ipc_copy_passes * shard / inp.hbm_bytes_per_s
        return inp.ipc_fixed_s + in_host + across + load
    # over NCCL: a broadcast a tensor, and SGLang's receiving side
    push = shape.hf_tensors * inp.push_tensor_s
    receive = 0.0
    if sglang:
        receive = inp.sglang_receive_fixed_s + nbytes / GB * inp.sglang_receive_s_per_gb
        receive += shape.expert_tensors * inp.sglang_receive_expert_tensor_s
    if transport == "bench":
        return push + nbytes / inp.nvlink_broadcast + receive
    link = inp.nvlink_broadcast if transport == "nvlink" else _nic(inp)
    return push + per_tensor + nbytes / link + receive


OFFLOADS = ("ahead", "serial", "none")


def trainer_state_bytes(
    shape: Shape, gpus: int, inp: ScaleInputs, tp: int = 1, cpu_adam: bool = False
) -> float:
    """What one trainer rank moves to host memory and back when it makes room for the engine: its bf16
    weights and gradients (the host-copy rate is fit to an offload at that count) and its optimizer
    shard, which with ``cpu_adam`` is in host memory already. ``tp`` as in :func:`train_s`."""
    m = tp if tp > 1 else model_parallel(shape, gpus, inp) or gpus
    optimizer = 0.0 if cpu_adam else inp.optimizer_bytes * shape.params / gpus
    return (2 + inp.grad_bytes) * shape.params / m + optimizer


def handover_s(
    shape: Shape,
    gpus: int,
    engine_gpus: int,
    kv_gb: float,
    inp: ScaleInputs,
    tp: int = 1,
    cpu_adam: bool = False,
    offload: str = "ahead",
    hidden: float = 0.0,
) -> float:
    """Colocated turns a step: the trainer's state out and back (:func:`trainer_state_bytes`), the
    engine's weights saved and restored, the KV pool released and mapped again. ``offload``
    (``colocation.trainer_offload``): ahead, the platform's default, moves the trainer's state out beside
    the next generation and back while the batch's last episodes generate, so only what ``hidden``
    seconds of generation do not cover is in the step; serial, every move in the step (the platform
    before 3fc7d3c, whose offload held the next generation back); none, the trainer's state stays on the
    GPUs."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload: one of {OFFLOADS}, not {offload!r}")
    trainer_state = trainer_state_bytes(shape, gpus, inp, tp, cpu_adam)
    engine_weights = 2.0 * shape.params / engine_gpus if inp.engine_weights_backup else 0.0
    trainer_moves = 0.0 if offload == "none" else 2 * trainer_state / inp.host_copy_bytes_per_s
    if offload == "ahead":
        trainer_moves = max(trainer_moves - hidden, 0.0)
    host = trainer_moves + 2 * engine_weights / inp.host_copy_bytes_per_s
    kv = (
        inp.kv_release_fixed_s
        + inp.kv_release_s_per_gb * kv_gb
        + inp.kv_resume_fixed_s
        + inp.kv_resume_s_per_gb * kv_gb
    )
    return host + kv


# --- a step at scale -----------------------------------------------------------------------------


def engine_gpus_for(shape: Shape, inp: ScaleInputs) -> int:
    """GPUs an engine spans: the fewest (a power of two) whose memory holds the weights twice over."""
    g = 1
    while 2.0 * shape.params / g > inp.gpu_memory / 2:
        g *= 2
    return g


def predict(shape: Shape, hosts: int, placement: str, w: Workload, inp: ScaleInputs) -> dict[str, Any]:
    """Step time, its parts and its bottleneck for ``hosts`` x 8 GPUs. ``placement``: colocated,
    disaggregated (no overlap) or async (disaggregated, one step off-policy)."""
    gpus = hosts * inp.gpus_per_host
    eg = engine_gpus_for(shape, inp)
    trajectories = w.batch(gpus)
    seq = w.prompt_tokens + w.response_tokens
    tokens = trajectories * seq
    out: dict[str, Any] = {"shape": shape.name, "hosts": hosts, "gpus": gpus, "placement": placement}
    if placement == "colocated":
        if model_parallel(shape, gpus, inp) is None:
            return {**out, "fits": False, "why": "the trainer's state does not fit these GPUs"}
        rollout = rollout_s(shape, trajectories, gpus // eg, eg, w, inp)
        train = sum(train_s(shape, tokens, gpus, seq, inp).values())
        # the KV pool takes what the engine's weights leave of 85% of a GPU (engine.mem_fraction-like)
        kv_gb = inp.gpu_memory * 0.85 / GB - 2.0 * shape.params / eg / GB
        parts = {
            "rollout": rollout,
            "train": train,
            "sync": sync_s(shape, "ipc", inp, model_parallel(shape, gpus, inp) or gpus, eg),
            "handover": handover_s(shape, gpus, eg, kv_gb, inp, hidden=rollout),
        }
        step, split = sum(parts.values()), None
    else:
        best = None
        for engine_share in range(eg, gpus, eg):
            trainer_gpus = gpus - engine_share
            m = model_parallel(shape, trainer_gpus, inp)
            if m is None or trainer_gpus % m:
                continue  # the trainer holds whole copies of the model only
            rollout = rollout_s(shape, trajectories, engine_share // eg, eg, w, inp)
            train = sum(train_s(shape, tokens, trainer_gpus, seq, inp).values())
            sync = sync_s(shape, "nvlink" if hosts == 1 else "network", inp) + inp.pause_s
            core = max(rollout, train) if placement == "async" else rollout + train
            if best is None or core + sync < best[0]:
                best = (core + sync, engine_share, {"rollout": rollout, "train": train, "sync": sync})
        if best is None:
            return {**out, "fits": False, "why": "no split leaves the trainer a whole copy that fits"}
        step, engine_share, parts = best
        split = {"engine_gpus": engine_share, "trainer_gpus": gpus - engine_share}
    bottleneck = max(parts, key=parts.get)
    return {
        **out,
        "fits": True,
        "step_s": round(step, 2),
        "parts_s": {k: round(v, 3) for k, v in parts.items()},
        "bottleneck": bottleneck,
        "split": split,
        "engine_gpus_each": eg,
        "trained_tokens_per_s_per_gpu": round(tokens / step / gpus),
        "extrapolated": extrapolated(shape, hosts, eg),
    }


def extrapolated(shape: Shape, hosts: int, engine_gpus: int) -> list[str]:
    """What a prediction rests on beyond measured ground."""
    if shape.name == "qwen2.5-7b":
        notes = [
            "whole 7B steps measured on 2 and 4 GPUs (TP2 trainers; 1+1 with CPU Adam) and one with 14 of "
            "its 28 layers on 1 GPU (no split, GPU Adam); none past one host"
        ]
    elif shape.name in ("qwen2.5-3b", "qwen2.5-1.5b"):
        notes = ["whole steps of this shape measured on 1 GPU only (no split, GPU Adam); none past one GPU"]
    else:
        notes = ["no whole RL step measured at this size"]
    if shape.experts:
        notes.append("trainer MoE MFU assumed: grouped expert GEMMs not measured on a GPU")
        notes.append("engine's expert reads checked on a 1B MoE only")
        notes.append(
            "per-tensor sync costs fit on 290-4,719 tensors (SGLang's load, NCCL's pushes, SGLang's "
            "receiving side) and 272-290 (the trainer's naming), "
            f"applied to {shape.hf_tensors:,}"
        )
    else:
        notes.append(
            "trainer MFU fit on one TP2 step of 2 GPUs; a one-GPU rank with no split checked at 14 of 7B's "
            "layers and the whole 3B and 1.5B shapes (within 4-8%), not past one GPU"
        )
    if engine_gpus > 1:
        notes.append("an engine spread over several GPUs: not measured")
    if hosts > 1:
        notes.append("cross-host links from vendor specs: nothing measured across hosts")
    return notes
