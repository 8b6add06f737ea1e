"""fp8 rollout on CPU: the per-channel quantization, the fp8 linear's arithmetic, the fp8 experts of a
mixture-of-experts layer (eager and graph kernels), the fp8 embedded engine, dense and Qwen3-MoE (its
logprobs near the fp32 engine's, re-quantized at every weight update) and the config checks.

The GPU kernels (``torch._scaled_mm``, ``torch._scaled_grouped_mm``) are not run here; the CPU path runs the
same quantize-dequantize arithmetic in plain torch, and the grouped kernel's call is checked against
torch's own checks of its arguments on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from agentrl.config import ConfigError
from agentrl.embedded.engine import EmbeddedEngine
from agentrl.embedded.fp8 import (
    FP8_MAX,
    Fp8Weight,
    copies_bytes,
    dequantize_rows,
    fp8_experts_grouped,
    fp8_experts_sorted,
    fp8_linear,
    quantize_rows,
    quantized_tensors,
)
from agentrl.embedded.runner import ExtendBatch, ModelRunner
from agentrl.embedded.sampling import RequestSampling
from agentrl.engine.launcher import SGLangConfig, SGLangLauncher
from agentrl.models.decoder import experts_grouped, route, torch_linear
from agentrl.recipe import load_run_config
from agentrl.run_checks import check_model_shape

GENERIC = ["model_path=/m", "data.path=/d", "env.name=math"]
MOE = {"num_experts": 8, "num_experts_per_tok": 2}


# ---- the quantization -----------------------------------------------------------------------------
def test_rows_round_trip_within_e4m3_precision_of_each_rows_scale() -> None:
    g = torch.Generator().manual_seed(0)
    # rows of very different magnitudes: one scale per row keeps each row's relative error
    w = torch.randn(6, 40, generator=g) * torch.tensor([1e-4, 1e-2, 1.0, 3.0, 100.0, 0.0])[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6,) and scale.dtype == torch.float32
    back = dequantize_rows(q, scale, torch.float32)
    amax = w.abs().amax(dim=1)
    err = (back - w).abs()
    # e4m3: 3 mantissa bits, so a value keeps a relative error of at most 2^-4 (half an ulp), and values
    # under the smallest normal (2^-6 in scaled units) an absolute one of half the subnormal step (2^-10)
    bound = torch.maximum(w.abs() * 2**-4, scale[:, None] * 2**-10)
    assert (err <= bound * (1 + 1e-6)).all()
    assert (err.amax(dim=1) <= amax * 2**-4 + 1e-12).all()
    assert torch.allclose(q.float().abs().amax(dim=1)[:5], torch.full((5,), FP8_MAX))  # amax -> 448
    assert scale[5] == 1.0 and (back[5] == 0).all()  # an all-zero row
    assert (err > 0).any()  # quantization does change the weights


def test_fp8_linear_is_the_quantize_dequantize_product_and_plain_weights_stay_plain() -> None:
    g = torch.Generator().manual_seed(1)
    x, w, b, r = (torch.randn(*s, generator=g) for s in ((2, 3, 32), (48, 32), (48,), (2, 3, 48)))
    fw = Fp8Weight.of(w)
    xq, xs = quantize_rows(x.reshape(-1, 32))
    want = dequantize_rows(xq, xs, torch.float32) @ dequantize_rows(fw.qweight, fw.scale, torch.float32).T + b
    got = fp8_linear(x, fw, b, residual=r)
    assert torch.equal(got, r + want.view(2, 3, 48))
    assert not torch.equal(got, torch_linear(x, w, b, r))
    assert torch.equal(fp8_linear(x, w, b, r), torch_linear(x, w, b, r))  # the LM head's path: untouched


# ---- the experts -----------------------------------------------------------------------------------
def test_fp8_experts_scale_each_experts_rows_and_both_kernels_compute_the_same() -> None:
    g = torch.Generator().manual_seed(2)
    h = torch.randn(37, 32, generator=g)
    gate_up, down = torch.randn(8, 48, 32, generator=g) / 6, torch.randn(8, 32, 24, generator=g) / 5
    gates, ids = route(h, torch.randn(8, 32, generator=g), 2, True)
    fgu, fd = Fp8Weight.of(gate_up), Fp8Weight.of(down)
    assert fgu.qweight.shape == (8, 48, 32) and fgu.scale.shape == (8, 48) and fd.scale.shape == (8, 32)
    for e in (0, 5):  # one scale per output row of each expert: every expert quantized on its own
        alone = Fp8Weight.of(gate_up[e])
        assert torch.equal(fgu[e].qweight.view(torch.uint8), alone.qweight.view(torch.uint8))
        assert torch.equal(fgu[e].scale, alone.scale) and fgu[e].source.data_ptr() == gate_up[e].data_ptr()
    eager = fp8_experts_grouped(h, gates, ids, fgu, fd)  # each expert's rows through fp8_linear
    graph = fp8_experts_sorted(h, gates, ids, fgu, fd)  # grouped products over expert-sorted rows
    plain = experts_grouped(h, gates, ids, gate_up, down)
    assert (eager - graph).abs().max() <= 1e-5
    gap = ((eager - plain).abs().max() / plain.abs().max()).item()
    assert 0 < gap < 0.1, gap  # fp8 rounding of weights and activations (0.052 measured here)


def test_the_grouped_fp8_gemm_call_passes_torchs_argument_checks() -> None:
    # torch._scaled_grouped_mm has no CPU kernel; its meta function runs the CUDA op's checks: fp8 operands,
    # the rows row-major and the weight column-major with 16-byte strides, fp32 rowwise scales [rows] and
    # [E, out], int32 offsets, a bf16 output
    meta = torch.device("meta")

    def experts(*shape: int) -> Fp8Weight:
        source = torch.empty(*shape, dtype=torch.bfloat16, device=meta)
        return Fp8Weight(source, *quantize_rows(source), scaled_mm=True, grouped=True)

    h = torch.empty(37, 64, dtype=torch.bfloat16, device=meta)
    gates = torch.empty(37, 2, dtype=torch.bfloat16, device=meta)
    ids = torch.empty(37, 2, dtype=torch.long, device=meta)
    y = fp8_experts_sorted(h, gates, ids, experts(8, 96, 64), experts(8, 64, 48))
    assert y.shape == (37, 64) and y.dtype == torch.bfloat16
    # without the grouped kernel the same call takes the fp32 arithmetic, which the GPU op refuses
    plain = Fp8Weight(*(getattr(experts(8, 96, 64), f) for f in ("source", "qweight", "scale")))
    with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
        fp8_experts_sorted(h, gates, ids, plain, experts(8, 64, 48))


# ---- the engine -----------------------------------------------------------------------------------
def _last_logprobs(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    logits = runner.extend(ExtendBatch([0], [tokens], [0]))
    return torch.log_softmax(logits.float(), dim=-1)[0]


def _greedy(n: int) -> RequestSampling:
    return RequestSampling(temperature=0.0, max_new_tokens=n, ignore_eos=True)


async def test_fp8_engine_generates_with_logprobs_near_the_fp32_engines(tiny_model_dir: Path) -> None:
    plain = EmbeddedEngine(tiny_model_dir, max_batch_size=2, prefix_cache_slots=0)
    fp8 = EmbeddedEngine(tiny_model_dir, max_batch_size=2, prefix_cache_slots=0, quantization="fp8")
    try:
        assert fp8.runner.weights[0].q is not plain.runner.weights[0].q
        assert isinstance(fp8.runner.weights[0].down, Fp8Weight)
        assert fp8.runner.lm_head_weight.dtype == torch.float32  # the LM head stays in the engine dtype
        prompt = list(range(20, 52))
        a = _last_logprobs(plain.runner, prompt)
        b = _last_logprobs(fp8.runner, prompt)
        gap = (a - b).abs().max().item()
        assert 0 < gap < 0.1, gap
        rec = await fp8.generate(prompt, _greedy(8), "r")
        assert len(rec.output_ids) == 8 and len(rec.logprobs) == 8
        assert all(lp <= 0 for lp in rec.logprobs)
        assert fp8.stats["quantize_s"] > 0 and "quantize_s" not in plain.stats
    finally:
        plain.shutdown()
        fp8.shutdown()


async def test_a_weight_update_requantizes(
    tiny_model_factory: Callable[..., Path], tiny_model_dir: Path
) -> None:
    from agentrl.embedded.weights import load_checkpoint
    from agentrl.engine.named_tensors import pack_named_tensors

    new_dir = tiny_model_factory("qwen2", seed=7)
    prompt = list(range(30, 60))
    fresh = EmbeddedEngine(new_dir, max_batch_size=2, prefix_cache_slots=0, quantization="fp8")
    disk = EmbeddedEngine(tiny_model_dir, max_batch_size=2, prefix_cache_slots=0, quantization="fp8")
    mem = EmbeddedEngine(tiny_model_dir, max_batch_size=2, prefix_cache_slots=0, quantization="fp8")
    try:
        want = await fresh.generate(prompt, _greedy(6), "f")
        before = await disk.generate(prompt, _greedy(6), "b")
        assert before.logprobs != want.logprobs
        await disk.update_weights_from_disk(str(new_dir), "v1", abort_all=False)
        packed = pack_named_tensors(list(load_checkpoint(new_dir, torch.float32).items()))
        try:
            await mem.update_weights_from_tensor([packed.payload], packed.load_format, "v1", abort_all=False)
        finally:
            packed.close()
        for engine in (disk, mem):
            got = await engine.generate(prompt, _greedy(6), "a")
            # bit for bit what a fresh fp8 engine of the new weights serves
            assert got.output_ids == want.output_ids and got.logprobs == want.logprobs
            for w_got, w_want in zip(engine.runner.weights, fresh.runner.weights, strict=True):
                assert torch.equal(w_got.o.qweight.view(torch.uint8), w_want.o.qweight.view(torch.uint8))
                assert torch.equal(w_got.o.scale, w_want.o.scale)
            assert engine.stats["quantize_s"] > 0
    finally:
        for engine in (fresh, disk, mem):
            engine.shutdown()


async def test_a_broadcast_update_requantizes(
    tiny_model_factory: Callable[..., Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    import asyncio

    from _trainer_helpers import start_broadcaster
    from safetensors.torch import save_file

    from agentrl.embedded.weights import load_checkpoint

    new_dir = tiny_model_factory("qwen2", seed=7)
    weights = load_checkpoint(new_dir, torch.float32)
    assert weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    sd = {n: t.contiguous() for n, t in weights.items() if n != "lm_head.weight"}  # tied: sent once
    save_file(sd, str(tmp_path / "w.safetensors"))
    names = list(sd)
    prompt = list(range(30, 60))
    fresh = EmbeddedEngine(new_dir, max_batch_size=2, prefix_cache_slots=0, quantization="fp8")
    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=2, prefix_cache_slots=0, quantization="fp8")
    sender, port = await start_broadcaster(str(tmp_path / "w.safetensors"), names, "fp8_sync")
    try:
        await engine.init_weights_update_group("127.0.0.1", port, 1, 2, "fp8_sync", "gloo")
        dtypes, shapes = [str(sd[n].dtype) for n in names], [list(sd[n].shape) for n in names]
        await engine.update_weights_from_distributed(names, dtypes, shapes, "fp8_sync", "v1", abort_all=False)
        out = (await asyncio.wait_for(sender.communicate(), 120))[0].decode()
        assert sender.returncode == 0 and "broadcast done" in out, out
        await engine.destroy_weights_update_group("fp8_sync")
        want = await fresh.generate(prompt, _greedy(6), "f")
        got = await engine.generate(prompt, _greedy(6), "g")
        assert got.output_ids == want.output_ids and got.logprobs == want.logprobs
    finally:
        if sender.returncode is None:
            sender.kill()
            await sender.wait()
        fresh.shutdown()
        engine.shutdown()


async def test_fp8_copies_go_and_come_back_with_the_weights(tiny_model_dir: Path) -> None:
    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=2, prefix_cache_slots=0, quantization="fp8")
    try:
        prompt = list(range(10, 40))
        before = await engine.generate(prompt, _greedy(6), "b")
        q = engine.runner.weights[0].q.qweight
        params = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        assert engine.memory_state()["weights_bytes"] > params  # the fp8 copies are counted in
        await engine.release_memory_occupation(["weights"])
        assert q.untyped_storage().nbytes() == 0  # released with the weights
        await engine.resume_memory_occupation(["weights"])
        after = await engine.generate(prompt, _greedy(6), "a")
        assert after.output_ids == before.output_ids and after.logprobs == before.logprobs
    finally:
        engine.shutdown()


async def test_fp8_moe_engine_serves_near_the_fp32_engine_and_requantizes_its_experts(
    tiny_model_factory: Callable[..., Path],
) -> None:
    base, new_dir = tiny_model_factory("qwen3_moe", **MOE), tiny_model_factory("qwen3_moe", seed=7, **MOE)
    kw = dict(max_batch_size=2, prefix_cache_slots=0)
    plain = EmbeddedEngine(base, **kw)
    fp8 = EmbeddedEngine(base, quantization="fp8", **kw)
    fresh = EmbeddedEngine(new_dir, quantization="fp8", **kw)
    try:
        experts = fp8.runner.weights[0].experts
        assert isinstance(experts.gate_up, Fp8Weight) and isinstance(experts.down, Fp8Weight)
        assert experts.gate_up.scale.shape == experts.gate_up.qweight.shape[:2]  # a scale per expert's row
        assert experts.router.dtype == torch.float32  # the router stays in the engine dtype
        # the engine plans its memory with the fp8 copies the experts take, and releases them with the weights
        held = quantized_tensors(fp8.runner.weights)
        assert {id(experts.gate_up.qweight), id(experts.down.scale)} <= {id(t) for t in held}
        assert copies_bytes(fp8.model, "fp8") == sum(t.numel() * t.element_size() for t in held)
        prompt = list(range(20, 52))
        gap = (_last_logprobs(plain.runner, prompt) - _last_logprobs(fp8.runner, prompt)).abs().max().item()
        assert 0 < gap < 0.1, gap  # 0.024 measured on this model
        rec = await fp8.generate(prompt, _greedy(8), "r")
        assert len(rec.output_ids) == 8 and all(lp <= 0 for lp in rec.logprobs)
        assert rec.routed_experts is not None and fp8.stats["quantize_s"] > 0

        want = await fresh.generate(prompt, _greedy(6), "f")
        await fp8.update_weights_from_disk(str(new_dir), "v1", abort_all=False)
        for w_got, w_want in zip(fp8.runner.weights, fresh.runner.weights, strict=True):
            for name in ("gate_up", "down"):  # bit for bit what a fresh fp8 engine of the new weights holds
                got_e, want_e = getattr(w_got.experts, name), getattr(w_want.experts, name)
                assert torch.equal(got_e.qweight.view(torch.uint8), want_e.qweight.view(torch.uint8))
                assert torch.equal(got_e.scale, want_e.scale)
        got = await fp8.generate(prompt, _greedy(6), "a")
        assert got.output_ids == want.output_ids and got.logprobs == want.logprobs
    finally:
        for engine in (plain, fp8, fresh):
            engine.shutdown()


def test_fp8_refuses_what_it_does_not_cover(tiny_model_factory: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="batch-invariant"):
        EmbeddedEngine(
            tiny_model_factory("qwen2"), max_batch_size=1, quantization="fp8", batch_invariant=True
        )


# ---- the config -----------------------------------------------------------------------------------
def test_config_checks_name_the_field(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    cfg = load_run_config(None, [*GENERIC, "engine.quantization=fp8"])
    assert cfg.engine.quantization == "fp8"
    bad = {
        "deterministic=true": "deterministic promises",
        "trainer.true_on_policy=true": "trainer.true_on_policy needs",
        "engine.backend=external": "not for external",
        "engine.quantization=int4": "engine.quantization",
        "engine.device=cuda": "needs engine.dtype: bfloat16",
    }
    for override, why in bad.items():
        extra = ["engine.urls=[http://x:1]"] if "external" in override else []
        with pytest.raises(ConfigError, match=rf"engine\.quantization.*{why}|{why}"):
            load_run_config(None, [*GENERIC, "engine.quantization=fp8", override, *extra])
    with pytest.raises(ConfigError, match=r"engine\.sglang\.quantization: the run sets it from engine"):
        load_run_config(None, [*GENERIC, "engine.backend=sglang", "engine.sglang.quantization=fp8"])
    check_model_shape(cfg, str(tiny_model_factory("qwen3")))  # covered
    check_model_shape(cfg, str(tiny_model_factory("qwen3_moe", **MOE)))  # covered: its experts too
    (tmp_path / "config.json").write_text('{"model_type": "gemma2", "num_attention_heads": 8}')
    with pytest.raises(ConfigError, match=r"engine\.quantization: fp8 in the embedded engine covers"):
        check_model_shape(cfg, str(tmp_path))


def test_sglang_gets_quantization_fp8() -> None:
    cfg = SGLangConfig(model_path="m", python="py", quantization="fp8", skip_tokenizer_init=False)
    cmd = SGLangLauncher(cfg).command()
    assert cmd[cmd.index("--quantization") + 1] == "fp8" and cmd.count("--quantization") == 1
    assert "--quantization" not in SGLangLauncher(SGLangConfig(model_path="m", python="py")).command()


# ---- the bench ------------------------------------------------------------------------------------
def test_mismatch_bench_prints_one_line_where_fp8_moves_the_logprobs() -> None:
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    args = ["--prompts", "2", "--prompt-len", "16", "--max-new-tokens", "8"]
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "fp8_mismatch.py"), *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    out = json.loads(lines[0])
    assert out["bench"] == "fp8_mismatch" and out["tokens"] == 16 and out["quantize_s"] > 0
    fields = {"mismatch_kl", "max_abs_dlogp", "tis_min", "tis_mean", "tis_max", "tis_std"}
    fp8, plain = out["fp8"], out["unquantized"]
    assert set(fp8) == fields == set(plain)
    assert fp8["mismatch_kl"] > 0 and fp8["mismatch_kl"] > plain["mismatch_kl"]
    assert fp8["max_abs_dlogp"] > plain["max_abs_dlogp"]
    assert 0 < fp8["tis_min"] <= fp8["tis_mean"] <= fp8["tis_max"] <= out["tis_cap"]


def test_the_server_serves_fp8_and_reports_the_quantization_time(tiny_model_dir: Path) -> None:
    import json
    import urllib.request

    from agentrl.embedded.launch import start_embedded_server

    with start_embedded_server(tiny_model_dir, max_batch_size=2, extra_args=["--quantization", "fp8"]) as srv:
        with urllib.request.urlopen(srv.url + "/get_server_info", timeout=30) as resp:
            info = json.loads(resp.read())
    assert info["quantize_s"] > 0
