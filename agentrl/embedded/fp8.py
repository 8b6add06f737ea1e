"""fp8 rollout: the embedded engine's projections and experts served as float8 e4m3, one scale per row.

The engine keeps the weights it is given (bf16, or fp32 on a CPU) as the model's parameters: loads, weight
updates (disk, tensor, broadcast) and LoRA merges write there, as without quantization. What the layers
run on is an :class:`Fp8Weight` per projection, quantized from that parameter at load and again after
every update (:func:`requantize`), in place, so CUDA graphs captured over it stay valid.

What is quantized: the attention's q/k/v (or fused qkv) and output projections and the MLP's gate/up (or
fused gate_up) and down projections of every layer; in a mixture-of-experts layer (Qwen3-MoE) every
expert's gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` in place of the dense MLP's. Embeddings, norms, the
router and the LM head stay in the engine's dtype; so do biases.

Scales are per output channel (one fp32 scale per weight row, ``amax(row) / 448``): the product
``x_q @ w_q.T`` then needs only a row scale (per token) and a column scale (per output channel) in its
epilogue, which ``torch._scaled_mm`` takes as rowwise scales on Hopper-class GPUs; an expert's rows get
scales of their own, as if each expert were a projection. Blockwise 128x128 scales are what large
mixture-of-experts checkpoints ship; for the models served here a scale per row loses little and keeps
the kernels plain. Activations are quantized per token, dynamically, at each projection.

:func:`fp8_linear` is the ``linear`` of :data:`FP8_OPS` (:class:`agentrl.models.decoder.DecoderOps`): a
plain tensor (the LM head) goes through :func:`agentrl.models.decoder.torch_linear`; an :class:`Fp8Weight`
through ``torch._scaled_mm`` on a GPU that has fp8 (compute capability 8.9 or more) and, elsewhere, through
the same quantize-dequantize arithmetic in plain torch, so CPU tests check the numerics' semantics.

The experts run as the unquantized ones do (:mod:`agentrl.models.decoder`), over the same records with
one scale per row of each expert: eagerly, :func:`fp8_experts_grouped` sends each expert's rows through
:func:`fp8_linear` (``torch._scaled_mm`` per expert on a GPU); under CUDA graphs,
:func:`fp8_experts_sorted` runs both GEMMs of all experts as one ``torch._scaled_grouped_mm`` each (the
activations quantized per row, rowwise scales, group offsets, a bf16 output). torch ships that kernel
for Hopper (compute capability 9.x) only: on other fp8 GPUs (Ada, Blackwell) :func:`sorted_experts`
gives none, and the engine serves a mixture-of-experts model eagerly (the per-expert ``torch._scaled_mm``
loop, no CUDA graphs), as it does an unquantized one where ``torch._grouped_mm`` is missing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import torch

from agentrl.models.decoder import (
    PROJECTION_FIELDS,
    TORCH_OPS,
    DecoderOps,
    ExpertsKernel,
    LayerWeights,
    experts_grouped,
    experts_sorted,
    torch_linear,
)

Tensor = torch.Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# a Qwen3-MoE layer's experts, as transformers names their fused parameters
EXPERTS_PARAMS = ("experts.gate_up_proj", "experts.down_proj")
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first with fp8 tensor cores
# the model families (HF model_type) fp8 serves: every one the embedded engine serves
FP8_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def quantize_rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """``(t_q float8_e4m3fn, scale fp32 [...rows])`` of ``t`` [..., rows, cols] with one scale per row: ``t ~
    t_q * scale[..., None]``, the row's largest magnitude mapped to e4m3's largest (448). An all-zero row gets
    scale 1 (its quantized values are zeros either way)."""
    t32 = t.float()
    amax = t32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (t32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``q * scale[..., None]`` in ``dtype``: what :func:`quantize_rows` gives back."""
    return (q.float() * scale[..., None]).to(dtype)


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """One projection served in fp8: ``qweight`` [out, in] float8_e4m3fn and ``scale`` [out] fp32,
    quantized from ``source``, the model's own parameter (which weight updates write); or a layer's
    experts, ``qweight`` [E, out, in] and ``scale`` [E, out], indexed by expert as a tensor is
    (``w[e]``: that expert's record, views of the same storage). ``scaled_mm``: whether its product runs
    ``torch._scaled_mm``; ``grouped``: whether the experts' grouped product runs
    ``torch._scaled_grouped_mm`` (both decided once here, not in the traced forward)."""

    source: Tensor
    qweight: Tensor
    scale: Tensor
    scaled_mm: bool = False
    grouped: bool = False

    @classmethod
    def of(cls, source: Tensor) -> Fp8Weight:
        q, scale = quantize_rows(source.detach())
        # the fp8 GEMMs want both sizes of a weight in multiples of 16
        fits = q.shape[-2] % 16 == 0 and q.shape[-1] % 16 == 0
        scaled_mm = fits and supports_fp8(source.device)
        grouped = scaled_mm and q.dim() == 3 and supports_fp8_grouped(source.device)
        return cls(source, q, scale, scaled_mm=scaled_mm, grouped=grouped)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def __getitem__(self, e: int) -> Fp8Weight:
        return Fp8Weight(self.source[e], self.qweight[e], self.scale[e], scaled_mm=self.scaled_mm)

    def requantize(self) -> None:
        """Quantize ``source`` again, into the same storage (captured CUDA graphs read it)."""
        q, scale = quantize_rows(self.source.detach())
        self.qweight.copy_(q)
        self.scale.copy_(scale)


def supports_fp8(device: torch.device) -> bool:
    """Whether ``device`` runs fp8 GEMMs: a CUDA GPU of compute capability 8.9 or more. (A CPU serves fp8
    by the quantize-dequantize arithmetic, for tests: see the module docstring.)"""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def supports_fp8_grouped(device: torch.device) -> bool:
    """Whether ``device`` runs the experts' fp8 grouped GEMM (``torch._scaled_grouped_mm`` with rowwise
    scales): torch builds it for Hopper GPUs (compute capability 9.x) only."""
    return (
        device.type == "cuda"
        and hasattr(torch, "_scaled_grouped_mm")
        and torch.cuda.get_device_capability(device)[0] == 9
    )


def check_fp8_device(device: torch.device) -> None:
    """Raise ValueError if ``device`` is a GPU without fp8 (compute capability under 8.9)."""
    if device.type == "cuda" and not supports_fp8(device):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(
            f"fp8: {torch.cuda.get_device_name(device)} (compute capability {cap}) has no fp8 GEMMs; fp8 "
            "needs compute capability 8.9 or more (Ada, Hopper and later)"
        )


def fp8_linear(
    x: Tensor, weight: Tensor | Fp8Weight, bias: Tensor | None = None, residual: Tensor | None = None
) -> Tensor:
    """``residual + (x @ weight.T + bias)`` with ``weight`` a plain tensor (as :func:`torch_linear`) or an
    :class:`Fp8Weight`: then ``x`` is quantized per token and the product scaled back by the token's scale
    and the output channel's, in ``x``'s dtype."""
    if not isinstance(weight, Fp8Weight):
        return torch_linear(x, weight, bias, residual)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows(x2)
    if weight.scaled_mm and x.dtype == torch.bfloat16:  # rowwise scales: a bf16 output
        y = torch._scaled_mm(
            xq,
            weight.qweight.t(),  # column-major [in, out], as the kernel's second operand must be
            scale_a=xs[:, None],
            scale_b=weight.scale[None, :],
            out_dtype=x.dtype,
        )
    else:  # the same arithmetic in plain torch: fp32 products of the dequantized operands, one rounding
        xd = dequantize_rows(xq, xs, torch.float32)
        wd = dequantize_rows(weight.qweight, weight.scale, torch.float32)
        y = torch.nn.functional.linear(xd, wd).to(x.dtype)
    if bias is not None:
        y = y + bias
    y = y.view(*lead, -1)
    return y if residual is None else residual + y


def fp8_grouped_mm(x: Tensor, w: Fp8Weight, offs: Tensor) -> Tensor:
    """The experts' grouped product (:data:`agentrl.models.decoder.GroupedMM`) in fp8: the rows of ``x``
    quantized per row, each group's rows times its expert's fp8 weight, scaled back by the row's scale and
    the expert's output channel's, in ``x``'s dtype. ``torch._scaled_grouped_mm`` where ``w.grouped``;
    elsewhere (a CPU: what the tests check) the quantize-dequantize arithmetic through
    ``torch._grouped_mm`` in fp32."""
    xq, xs = quantize_rows(x)
    if w.grouped and x.dtype == torch.bfloat16:
        # x row-major, the weight column-major ([E, in, out] view of [E, out, in]), scales [rows] and [E, out]
        return torch._scaled_grouped_mm(
            xq, w.qweight.transpose(-2, -1), xs, w.scale, offs=offs, out_dtype=x.dtype
        )
    xd = dequantize_rows(xq, xs, torch.float32)
    wd = dequantize_rows(w.qweight, w.scale, torch.float32)
    return torch._grouped_mm(xd, wd.transpose(-2, -1), offs=offs).to(x.dtype)


def fp8_experts_grouped(h: Tensor, gates: Tensor, ids: Tensor, gate_up: Fp8Weight, down: Fp8Weight) -> Tensor:
    """:func:`agentrl.models.decoder.experts_grouped` over fp8 experts: each expert's rows through
    :func:`fp8_linear` (eager: CPU, or a GPU without graphs)."""
    return experts_grouped(h, gates, ids, gate_up, down, linear=fp8_linear)


def fp8_experts_sorted(h: Tensor, gates: Tensor, ids: Tensor, gate_up: Fp8Weight, down: Fp8Weight) -> Tensor:
    """:func:`agentrl.models.decoder.experts_sorted` over fp8 experts: no host syncs (CUDA graphs), each
    GEMM one :func:`fp8_grouped_mm`."""
    return experts_sorted(h, gates, ids, gate_up, down, mm=fp8_grouped_mm)


def sorted_experts(device: torch.device) -> ExpertsKernel | None:
    """The fp8 experts kernel that CUDA graphs can capture on ``device`` (:func:`fp8_experts_sorted`), or
    None where torch has no fp8 grouped GEMM for it (:func:`supports_fp8_grouped`): the engine then runs
    the experts eagerly, without graphs."""
    return fp8_experts_sorted if supports_fp8_grouped(device) else None


FP8_OPS = DecoderOps(
    linear=fp8_linear,
    rms_norm=TORCH_OPS.rms_norm,
    rope=TORCH_OPS.rope,
    silu_mul=TORCH_OPS.silu_mul,
    experts=fp8_experts_grouped,
)


def quantize_layer(w: LayerWeights) -> LayerWeights:
    """``w`` with each of its projections (:data:`PROJECTION_FIELDS`), and its experts' ``gate_up`` and
    ``down``, as :class:`Fp8Weight` records."""
    given = {f.name: getattr(w, f.name) for f in fields(w) if f.name in PROJECTION_FIELDS}
    out = replace(w, **{n: Fp8Weight.of(t) for n, t in given.items() if t is not None})
    if w.experts is not None:
        e = w.experts
        out = replace(out, experts=replace(e, gate_up=Fp8Weight.of(e.gate_up), down=Fp8Weight.of(e.down)))
    return out


def _fp8_weights(layers: list[LayerWeights]) -> Iterator[Fp8Weight]:
    """Every :class:`Fp8Weight` of ``layers``: projections, then experts."""
    for w in layers:
        for t in [getattr(w, name) for name in PROJECTION_FIELDS] + (
            [w.experts.gate_up, w.experts.down] if w.experts is not None else []
        ):
            if isinstance(t, Fp8Weight):
                yield t


def quantized_tensors(layers: list[LayerWeights]) -> list[Tensor]:
    """The fp8 weights and scales of ``layers``: device memory the engine releases with its weights."""
    return [t for w in _fp8_weights(layers) for t in (w.qweight, w.scale)]


def requantize(layers: list[LayerWeights]) -> float:
    """Quantize every :class:`Fp8Weight` of ``layers`` again from its source parameter (after a weight
    update wrote the parameters); the seconds it took (on a GPU until the kernels ended, not their launch)."""
    t0, devices = time.perf_counter(), set()
    with torch.no_grad():
        for t in _fp8_weights(layers):
            t.requantize()
            devices.add(t.qweight.device)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def quantized_layers(
    quantization: str, layers: list[LayerWeights], batch_invariant: bool, device: torch.device
) -> list[LayerWeights]:
    """The layers' weights with their projections and experts quantized (what the engine's runner serves),
    after the checks that the engine can: fp8 only, not with batch-invariant kernels, a device with fp8
    GEMMs."""
    if quantization != "fp8":
        raise ValueError(f"quantization: fp8 or none, not {quantization!r}")
    if batch_invariant:
        raise ValueError("quantization fp8 and batch-invariant mode exclude each other")
    check_fp8_device(device)
    return [quantize_layer(w) for w in layers]


def copies_bytes(model: torch.nn.Module, quantization: str | None) -> int:
    """Device bytes the fp8 copies of ``model``'s layers' projections and experts take (0 without
    quantization): a byte per value and an fp32 scale per row."""
    if quantization is None:
        return 0
    layers = model.model.layers
    quantized = [m.weight for m in layers.modules() if isinstance(m, torch.nn.Linear)]
    quantized += [p for n, p in layers.named_parameters() if n.endswith(EXPERTS_PARAMS)]
    return sum(w.numel() + 4 * (w.numel() // w.shape[-1]) for w in quantized)


__all__ = [
    "FP8_MODEL_TYPES",
    "FP8_OPS",
    "Fp8Weight",
    "check_fp8_device",
    "copies_bytes",
    "dequantize_rows",
    "fp8_experts_grouped",
    "fp8_experts_sorted",
    "fp8_grouped_mm",
    "fp8_linear",
    "quantize_layer",
    "quantize_rows",
    "quantized_layers",
    "quantized_tensors",
    "requantize",
    "sorted_experts",
    "supports_fp8",
    "supports_fp8_grouped",
]
