"""fp8 rollout: the embedded engine's decoder projections served as float8 (e4m3) with one scale per row.

The engine keeps the weights it is given (bf16, or fp32 on a CPU) as the model's parameters: loads, weight
updates (disk, tensor, broadcast) and LoRA merges write there, as without quantization. What the layers
run on is an :class:`Fp8Weight` per projection, quantized from that parameter at load and again after
every update (:func:`requantize`), in place, so CUDA graphs captured over it stay valid.

What is quantized: the attention's q/k/v (or fused qkv) and output projections and the MLP's gate/up (or
fused gate_up) and down projections of every dense layer. Embeddings, norms and the LM head stay in the
engine's dtype; so do biases. The experts of a mixture-of-experts layer are not covered (the grouped
expert GEMMs have no fp8 path here), so fp8 serves the dense families only: Llama, Qwen2, Qwen3.

Scales are per output channel (one fp32 scale per weight row, ``amax(row) / 448``): the product
``x_q @ w_q.T`` then needs only a row scale (per token) and a column scale (per output channel) in its
epilogue, which ``torch._scaled_mm`` takes as rowwise scales on Hopper-class GPUs. Blockwise 128x128
scales are what large mixture-of-experts checkpoints ship; for the dense models served here a scale per
row loses little and keeps the kernel plain. Activations are quantized per token, dynamically, at each
projection.

:func:`fp8_linear` is the ``linear`` of :data:`FP8_OPS` (:class:`agentrl.models.decoder.DecoderOps`): a
plain tensor (the LM head) goes through :func:`agentrl.models.decoder.torch_linear`; an :class:`Fp8Weight`
through ``torch._scaled_mm`` on a GPU that has fp8 (compute capability 8.9 or more) and, elsewhere, through
the same quantize-dequantize arithmetic in plain torch, so CPU tests check the numerics' semantics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace

import torch

from agentrl.models.decoder import TORCH_OPS, DecoderOps, LayerWeights, torch_linear

Tensor = torch.Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# the projections of a layer that fp8 serves (LayerWeights' field names)
LINEAR_FIELDS = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first with fp8 tensor cores
# the model families (HF model_type) fp8 serves: the embedded engine's dense ones
FP8_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def quantize_rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """``(t_q float8_e4m3fn, scale fp32 [rows])`` of the 2-D ``t`` with one scale per row: ``t ~ t_q *
    scale[:, None]``, the row's largest magnitude mapped to e4m3's largest (448). An all-zero row gets scale
    1 (its quantized values are zeros either way)."""
    t32 = t.float()
    amax = t32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (t32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``q * scale[:, None]`` in ``dtype``: what :func:`quantize_rows` gives back."""
    return (q.float() * scale[..., None]).to(dtype)


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """One projection served in fp8: ``qweight`` [out, in] float8_e4m3fn and ``scale`` [out] fp32,
    quantized from ``source``, the model's own parameter (which weight updates write). ``scaled_mm``:
    whether its product runs ``torch._scaled_mm`` (decided once here, not in the traced forward)."""

    source: Tensor
    qweight: Tensor
    scale: Tensor
    scaled_mm: bool = False

    @classmethod
    def of(cls, source: Tensor) -> Fp8Weight:
        q, scale = quantize_rows(source.detach())
        # the fp8 GEMM wants both sizes of the weight in multiples of 16
        fits = q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0
        return cls(source, q, scale, scaled_mm=fits and supports_fp8(source.device))

    def requantize(self) -> None:
        """Quantize ``source`` again, into the same storage (captured CUDA graphs read it)."""
        q, scale = quantize_rows(self.source.detach())
        self.qweight.copy_(q)
        self.scale.copy_(scale)


def supports_fp8(device: torch.device) -> bool:
    """Whether ``device`` runs fp8 GEMMs: a CUDA GPU of compute capability 8.9 or more. (A CPU serves fp8
    by the quantize-dequantize arithmetic, for tests: see the module docstring.)"""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


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


FP8_OPS = DecoderOps(
    linear=fp8_linear,
    rms_norm=TORCH_OPS.rms_norm,
    rope=TORCH_OPS.rope,
    silu_mul=TORCH_OPS.silu_mul,
    experts=None,  # mixture-of-experts layers are not served in fp8
)


def quantize_layer(w: LayerWeights) -> LayerWeights:
    """``w`` with each of its projections (:data:`LINEAR_FIELDS`) as an :class:`Fp8Weight`."""
    if w.experts is not None:
        raise ValueError(
            "fp8 serves dense layers only; the experts of a mixture-of-experts layer are not covered"
        )
    given = {f.name: getattr(w, f.name) for f in fields(w) if f.name in LINEAR_FIELDS}
    return replace(w, **{n: Fp8Weight.of(t) for n, t in given.items() if t is not None})


def quantized_tensors(layers: list[LayerWeights]) -> list[Tensor]:
    """The fp8 weights and scales of ``layers``: device memory the engine releases with its weights."""
    out = []
    for w in layers:
        for name in LINEAR_FIELDS:
            t = getattr(w, name)
            if isinstance(t, Fp8Weight):
                out += [t.qweight, t.scale]
    return out


def requantize(layers: list[LayerWeights]) -> float:
    """Quantize every :class:`Fp8Weight` of ``layers`` again from its source parameter (after a weight
    update wrote the parameters); the seconds it took (on a GPU until the kernels ended, not their launch)."""
    t0, devices = time.perf_counter(), set()
    with torch.no_grad():
        for w in layers:
            for name in LINEAR_FIELDS:
                t = getattr(w, name)
                if isinstance(t, Fp8Weight):
                    t.requantize()
                    devices.add(t.qweight.device)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def quantized_layers(
    quantization: str, layers: list[LayerWeights], moe: bool, batch_invariant: bool, device: torch.device
) -> list[LayerWeights]:
    """The layers' weights with their projections quantized (what the engine's runner serves), after the
    checks that the engine can: fp8 only, dense models only, not with batch-invariant kernels, a device
    with fp8 GEMMs."""
    if quantization != "fp8":
        raise ValueError(f"quantization: fp8 or none, not {quantization!r}")
    if moe:
        raise ValueError(
            "quantization fp8 serves dense models only (Llama, Qwen2, Qwen3); the experts of a "
            "mixture-of-experts model are not covered: serve it unquantized, or with SGLang"
        )
    if batch_invariant:
        raise ValueError("quantization fp8 and batch-invariant mode exclude each other")
    check_fp8_device(device)
    return [quantize_layer(w) for w in layers]


def copies_bytes(model: torch.nn.Module, quantization: str | None) -> int:
    """Device bytes the fp8 copies of ``model``'s layers' projections take (0 without quantization): a
    byte per value and an fp32 scale per row."""
    if quantization is None:
        return 0
    linear = [m.weight for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    return sum(w.numel() + 4 * w.shape[0] for w in linear)


__all__ = [
    "FP8_MODEL_TYPES",
    "FP8_OPS",
    "LINEAR_FIELDS",
    "Fp8Weight",
    "check_fp8_device",
    "copies_bytes",
    "dequantize_rows",
    "fp8_linear",
    "quantize_layer",
    "quantize_rows",
    "quantized_layers",
    "quantized_tensors",
    "requantize",
    "supports_fp8",
]
