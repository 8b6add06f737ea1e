"""fp8 rollout on a GPU of compute capability 8.9+ (``python -m pytest -m gpu tests/test_gpu_fp8.py``):
``torch._scaled_mm`` with rowwise scales gives the product the CPU path's quantize-dequantize arithmetic
describes, and a bf16 fp8 engine (CUDA graphs, optionally torch.compile) generates, with its weights
quantized again after an update."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from agentrl.embedded.engine import EmbeddedEngine
from agentrl.embedded.fp8 import Fp8Weight, dequantize_rows, fp8_linear, quantize_rows, supports_fp8
from agentrl.embedded.sampling import RequestSampling

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
        sp = RequestSampling(temperature=0.0, max_new_tokens=16, ignore_eos=True)
        prompt = list(range(30, 90))
        await engine.update_weights_from_disk(str(new_dir), "v1", abort_all=False)
        for w_got, w_want in zip(engine.runner.weights, fresh.runner.weights, strict=True):
            assert torch.equal(w_got.down.qweight.view(torch.uint8), w_want.down.qweight.view(torch.uint8))
            assert torch.equal(w_got.down.scale, w_want.down.scale)
        got = await engine.generate(prompt, sp, "g")
        want = await fresh.generate(prompt, sp, "f")
        ref = await plain.generate(prompt, sp, "p")
        assert got.output_ids == want.output_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-3
        same = [a == b for a, b in zip(got.output_ids, ref.output_ids, strict=True)]
        n = same.index(False) if False in same else len(same)  # where fp8 and bf16 chose the same tokens
        if n:  # their logprobs are close
            assert max(abs(a - b) for a, b in zip(got.logprobs[:n], ref.logprobs[:n], strict=True)) < 0.5
        assert engine.stats["quantize_s"] > 0
    finally:
        for e in (fresh, engine, plain):
            e.shutdown()
