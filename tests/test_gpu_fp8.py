"""fp8 rollout on a GPU of compute capability 8.9+ (``python -m pytest -m gpu tests/test_gpu_fp8.py``):
``torch._scaled_mm`` with rowwise scales gives the product the CPU path's quantize-dequantize arithmetic
describes, and a bf16 fp8 engine (CUDA graphs, optionally torch.compile) generates, with its weights
quantized again after an update. For a Qwen3-MoE model: on Hopper the experts' ``torch._scaled_grouped_mm``
(the CUDA-graph kernel) computes what the per-expert ``torch._scaled_mm`` loop does, and the fp8 MoE engine
serves (with graphs where that kernel exists, eagerly elsewhere) and re-quantizes its experts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from agentrl.embedded.engine import EmbeddedEngine
from agentrl.embedded.fp8 import (
    Fp8Weight,
    dequantize_rows,
    fp8_experts_grouped,
    fp8_experts_sorted,
    fp8_linear,
    quantize_rows,
    supports_fp8,
    supports_fp8_grouped,
)
from agentrl.embedded.request import GenerationRecord
from agentrl.embedded.sampling import RequestSampling
from agentrl.models.decoder import experts_grouped, route

pytestmark = pytest.mark.gpu


def _device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    if not supports_fp8(dev):
        pytest.fail(f"fp8 needs compute capability 8.9+, not {torch.cuda.get_device_capability(dev)}")
    return dev


def test_scaled_mm_is_the_quantize_dequantize_product() -> None:
    dev = _device()
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(37, 256, device=dev, generator=g).to(torch.bfloat16)
    w = torch.randn(384, 256, device=dev, generator=g).to(torch.bfloat16)
    fw = Fp8Weight.of(w)
    assert fw.scaled_mm
    got = fp8_linear(x, fw)
    xq, xs = quantize_rows(x)
    want = dequantize_rows(xq, xs, torch.float32) @ dequantize_rows(fw.qweight, fw.scale, torch.float32).T
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)  # one bf16 rounding of the output


async def _assert_serves_as_fresh_fp8(
    engine: EmbeddedEngine, fresh: EmbeddedEngine, plain: EmbeddedEngine
) -> GenerationRecord:
    """``engine`` (fp8, after an update) answers a greedy request as ``fresh`` (fp8, loaded with the new
    weights) does, and its logprobs stay close to ``plain``'s (unquantized) while their tokens agree; its
    answer back."""
    sp = RequestSampling(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    prompt = list(range(30, 90))
    got = await engine.generate(prompt, sp, "g")
    want = await fresh.generate(prompt, sp, "f")
    ref = await plain.generate(prompt, sp, "p")
    assert got.output_ids == want.output_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-3
    same = [a == b for a, b in zip(got.output_ids, ref.output_ids, strict=True)]
    n = same.index(False) if False in same else len(same)  # where fp8 and bf16 chose the same tokens
    if n:  # their logprobs are close
        assert max(abs(a - b) for a, b in zip(got.logprobs[:n], ref.logprobs[:n], strict=True)) < 0.5
    return got


@pytest.mark.parametrize("compile", [False, True])
async def test_fp8_engine_on_cuda_generates_and_requantizes(
    tiny_model_factory: Callable[..., Path], tiny_model_dir: Path, compile: bool
) -> None:
    dev = _device()
    kw = dict(device=str(dev), dtype="bfloat16", max_batch_size=4, prefix_cache_slots=0, compile=compile)
    new_dir = tiny_model_factory("qwen2", seed=7)
    fresh = EmbeddedEngine(new_dir, quantization="fp8", **kw)
    engine = EmbeddedEngine(tiny_model_dir, quantization="fp8", **kw)
    plain = EmbeddedEngine(new_dir, **kw)
    try:
        assert engine.runner.weights[0].q.scaled_mm
        await engine.update_weights_from_disk(str(new_dir), "v1", abort_all=False)
        for w_got, w_want in zip(engine.runner.weights, fresh.runner.weights, strict=True):
            assert torch.equal(w_got.down.qweight.view(torch.uint8), w_want.down.qweight.view(torch.uint8))
            assert torch.equal(w_got.down.scale, w_want.down.scale)
        await _assert_serves_as_fresh_fp8(engine, fresh, plain)
        assert engine.stats["quantize_s"] > 0
    finally:
        for e in (fresh, engine, plain):
            e.shutdown()


def test_fp8_experts_grouped_gemm_is_the_per_expert_loop() -> None:
    dev = _device()
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(torch.bfloat16)

    h, router = randn(300, 256), randn(8, 256, scale=1 / 16)
    gate_up, down = randn(8, 512, 256, scale=1 / 16), randn(8, 256, 256, scale=1 / 16)
    gates, ids = route(h, router, 2, True)
    fgu, fd = Fp8Weight.of(gate_up), Fp8Weight.of(down)
    assert fgu.scaled_mm and fgu[3].scaled_mm
    assert fgu.grouped == supports_fp8_grouped(dev) == (torch.cuda.get_device_capability(dev)[0] == 9)
    eager = fp8_experts_grouped(h, gates, ids, fgu, fd)  # torch._scaled_mm per expert
    plain = experts_grouped(h, gates, ids, gate_up, down)
    assert eager.dtype == torch.bfloat16
    assert 0 < ((eager - plain).abs().max() / plain.abs().max()).item() < 0.1  # fp8's rounding
    if fgu.grouped:  # Hopper: one torch._scaled_grouped_mm per GEMM, the same products
        graph = fp8_experts_sorted(h, gates, ids, fgu, fd)
        assert graph.dtype == torch.bfloat16
        assert ((graph - eager).abs().max() / eager.abs().max()).item() < 1e-2  # bf16 roundings apart


async def test_fp8_moe_engine_on_cuda_serves_and_requantizes_its_experts(
    tiny_model_factory: Callable[..., Path],
) -> None:
    dev = _device()
    moe = dict(num_experts=8, num_experts_per_tok=2)
    kw = dict(device=str(dev), dtype="bfloat16", max_batch_size=4, prefix_cache_slots=0)
    new_dir = tiny_model_factory("qwen3_moe", seed=7, **moe)
    engine = EmbeddedEngine(tiny_model_factory("qwen3_moe", **moe), quantization="fp8", **kw)
    fresh = EmbeddedEngine(new_dir, quantization="fp8", **kw)
    plain = EmbeddedEngine(new_dir, **kw)
    try:
        experts = engine.runner.weights[0].experts
        assert experts.gate_up.scaled_mm and experts.down.scaled_mm
        # CUDA graphs where torch has the fp8 grouped GEMM (Hopper); the eager per-expert loop elsewhere
        assert engine.runner.cuda_graphs == experts.gate_up.grouped == supports_fp8_grouped(dev)
        await engine.update_weights_from_disk(str(new_dir), "v1", abort_all=False)
        for w_got, w_want in zip(engine.runner.weights, fresh.runner.weights, strict=True):
            for got_e, want_e in (
                (w_got.experts.gate_up, w_want.experts.gate_up),
                (w_got.experts.down, w_want.experts.down),
            ):
                assert torch.equal(got_e.qweight.view(torch.uint8), want_e.qweight.view(torch.uint8))
                assert torch.equal(got_e.scale, want_e.scale)
        got = await _assert_serves_as_fresh_fp8(engine, fresh, plain)
        assert got.routed_experts is not None and engine.stats["quantize_s"] > 0
    finally:
        for e in (fresh, engine, plain):
            e.shutdown()
