"""Unmerged LoRA serving in the embedded engine on CPU (fp32): each adapted projection runs
``x W^T + (x A^T) (s · B)^T`` from records whose adapter buffers an update overwrites in place.

* The record's product is the trainer's adapter formula: the same bits for a power-of-two scale and a
  buffer of the adapter's own rank; within fp32 rounding otherwise; over an fp8 base, the fp8 product plus
  the adapter's.
* An unmerged engine serves a merging engine's greedy tokens, logprobs within :data:`TOL`, after an adapter
  in memory and one from a PEFT dir (a smaller rank than its buffers, then some modules only); a sync
  writes only the adapter buffers (every parameter keeps its bits, the buffers their addresses, as CUDA
  graphs need); unloading gives the base model's bits back.
* Buffers are made at the first adapter when no rank was given, and again, larger, for a larger one; a
  full weight update serves the new weights alone; the buffers go and come back with the weights' memory;
  with fp8 the base stays quantized as it was (no requantization at an adapter sync).
* An adapter on a weight that is no layer projection is refused naming ``--lora-apply merged``; the run's
  ``engine.lora_apply`` and ``trainer.lora.rank`` reach the engines it starts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from agentrl.embedded.engine import EmbeddedEngine
from agentrl.embedded.fp8 import Fp8Weight, fp8_linear
from agentrl.embedded.runner import ExtendBatch
from agentrl.embedded.sampling import EngineBadRequest, RequestSampling
from agentrl.engine.named_tensors import pack_named_tensors
from agentrl.models.lora import LoraWeight, lora_linear, scaled_b

KW = dict(max_batch_size=2, prefix_cache_slots=0)
PROMPTS = [list(range(20, 40)), [300, 12, 8, 5], list(range(100, 111))]
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# fp32 on a CPU: an unmerged engine's logprobs against a merging one's (measured: about 5e-7)
TOL = 1e-5


def _adapter(
    engine: EmbeddedEngine, rank: int, seed: int, modules: tuple[str, ...] = MODULES
) -> dict[str, torch.Tensor]:
    """A PEFT state dict of random adapters (B not zero: the answers move) for ``modules`` of every layer."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in engine.model.state_dict().items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in modules:
            out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, p.shape[1], generator=g) * 0.2
            out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(p.shape[0], rank, generator=g) * 0.2
    return out


async def _from_tensors(engine: EmbeddedEngine, tensors: dict, config: dict, version: str) -> None:
    packed = pack_named_tensors(list(tensors.items()))
    try:
        await engine.load_lora_adapter_from_tensors(
            "a", config, packed.payload, packed.load_format, version, abort_all=False
        )
    finally:
        packed.close()


def _peft_dir(out: Path, tensors: dict, config: dict) -> Path:
    out.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


async def _answers(engine: EmbeddedEngine) -> list[tuple[list[int], list[float]]]:
    out = []
    for i, p in enumerate(PROMPTS):
        rec = await engine.generate(
            p, RequestSampling(temperature=0.0, max_new_tokens=8, ignore_eos=True), f"r{i}"
        )
        out.append((rec.output_ids, rec.logprobs))
    return out


def _gap(a: list, b: list) -> float:
    """The largest logprob gap of two engines' greedy answers, which must hold the same tokens."""
    assert [ids for ids, _ in a] == [ids for ids, _ in b]
    return max(abs(x - y) for (_, u), (_, v) in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def _addresses(engine: EmbeddedEngine) -> dict[str, tuple[int, int]]:
    return {n: (r.a.data_ptr(), r.b.data_ptr()) for n, r in engine.lora.records.items()}


# ---- the record -----------------------------------------------------------------------------------
def test_the_records_product_is_the_trainers_adapter_formula() -> None:
    from agentrl.trainer.lora import LoRAAdapter

    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 3, 48, generator=g), torch.randn(5, 3, 32, generator=g)
    w, bias = torch.randn(32, 48, generator=g) * 0.1, torch.randn(32, generator=g)
    a, b = torch.randn(4, 48, generator=g) * 0.1, torch.randn(32, 4, generator=g) * 0.1

    def trainer(scale: float) -> torch.Tensor:  # the trainer's hook: the base output, plus its adapter's
        adapter = LoRAAdapter(a, b, scale, "column", tp=1, dropout=0.0, mask=None)
        with torch.no_grad():
            return residual + (F.linear(x, w, bias) + adapter(x))

    # a power-of-two scale on B is exact, and a buffer of the adapter's rank sums the same products
    same = lora_linear(x, LoraWeight(w, a, scaled_b(b, 2.0, torch.float32)), bias, residual)
    assert torch.equal(same, trainer(2.0))
    # a buffer of a larger rank (zeros past the adapter's) and a scale that rounds: within fp32 rounding
    s = 16 / math.sqrt(8)  # rsLoRA's alpha / sqrt(r)
    pa, pb = torch.zeros(8, 48), torch.zeros(32, 8)
    pa[:4], pb[:, :4] = a, scaled_b(b, s, torch.float32)
    torch.testing.assert_close(
        lora_linear(x, LoraWeight(w, pa, pb), bias, residual), trainer(s), rtol=1e-6, atol=1e-6
    )
    # over an fp8 base: the fp8 product, plus the adapter's in the activations' dtype
    q = Fp8Weight.of(w)
    got = lora_linear(x, LoraWeight(q, a, b), bias, linear=fp8_linear)
    assert torch.equal(got, fp8_linear(x, q, bias) + F.linear(F.linear(x, a), b))
    assert torch.equal(lora_linear(x, w, bias), F.linear(x, w, bias))  # a plain weight goes through


# ---- the engine -----------------------------------------------------------------------------------
async def test_unmerged_engine_serves_the_merging_engines_answers_from_adapter_bytes_only(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    merging = EmbeddedEngine(tiny_model_dir, lora_apply="merged", **KW)
    engine = EmbeddedEngine(tiny_model_dir, max_lora_rank=8, **KW)  # unmerged: the default
    try:
        base = await _answers(engine)
        assert base == await _answers(merging)
        params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        addresses = _addresses(engine)
        assert len(addresses) == 2 * len(MODULES)  # 2 layers, every projection
        buffers = 8 * sum(p.shape[0] + p.shape[1] for n, p in params.items() if n.endswith("_proj.weight"))
        assert engine.lora.num_bytes == 4 * buffers  # fp32 A and B of rank 8, one device buffer

        # an adapter in memory, of rank 4 in buffers of rank 8
        first = _adapter(engine, rank=4, seed=1)
        for e in (merging, engine):
            await _from_tensors(e, first, {"r": 4, "lora_alpha": 8}, "1")
        got = await _answers(engine)
        assert _gap(got, await _answers(merging)) <= TOL
        assert [lp for _, lp in got] != [lp for _, lp in base]
        # the sync wrote the adapter buffers only: every weight keeps its bits, every buffer its address
        for n, p in engine.model.named_parameters():
            assert torch.equal(p, params[n]), n
        assert _addresses(engine) == addresses and merging.lora.num_bytes > 0 == len(merging.lora.tensors())
        rec = engine.lora.records["model.layers.1.mlp.down_proj.weight"]
        assert torch.equal(rec.a[:4], first["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"])
        assert torch.equal(
            rec.b[:, :4], 2.0 * first["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
        )
        assert not rec.a[4:].any() and not rec.b[:, 4:].any()

        # a PEFT dir of rank 8 on q and v only: the other projections serve their base weights again
        second = _adapter(engine, rank=8, seed=2, modules=("q_proj", "v_proj"))
        peft = _peft_dir(tmp_path / "adapter", second, {"r": 8, "lora_alpha": 16})
        for e in (merging, engine):
            await e.load_lora_adapter("a", str(peft), "2", abort_all=False)
        assert _gap(await _answers(engine), await _answers(merging)) <= TOL
        assert not engine.lora.records["model.layers.0.mlp.up_proj.weight"].b.any()
        assert _addresses(engine) == addresses

        await engine.unload_lora_adapter("a")
        assert await _answers(engine) == base  # B zero: exact zeros added, the base model's bits
        assert _addresses(engine) == addresses and engine.lora.name is None
    finally:
        merging.shutdown()
        engine.shutdown()


async def test_buffers_come_with_the_first_adapter_and_grow_for_a_larger_one(tiny_model_dir: Path) -> None:
    merging = EmbeddedEngine(tiny_model_dir, lora_apply="merged", **KW)
    engine = EmbeddedEngine(tiny_model_dir, **KW)  # no rank given: no records before an adapter
    try:
        weights_bytes = engine.memory_state()["weights_bytes"]
        assert engine.lora.rank == 0 and engine.runner.served is engine.runner.weights
        await _from_tensors(engine, _adapter(engine, rank=2, seed=3), {"r": 2, "lora_alpha": 4}, "1")
        assert engine.lora.rank == 2 and isinstance(engine.runner.served[0].q, LoraWeight)
        small = _addresses(engine)
        assert engine.memory_state()["weights_bytes"] == weights_bytes + engine.lora.num_bytes

        larger = _adapter(engine, rank=6, seed=4)
        for e in (merging, engine):
            await _from_tensors(e, larger, {"r": 6, "lora_alpha": 12}, "2")
        assert engine.lora.rank == 6 and _addresses(engine) != small
        assert engine.memory_state()["weights_bytes"] == weights_bytes + engine.lora.num_bytes
        assert _gap(await _answers(engine), await _answers(merging)) <= TOL

        grown = _addresses(engine)  # a smaller adapter again: the buffers stay
        smaller = _adapter(engine, rank=2, seed=5)
        for e in (merging, engine):
            await _from_tensors(e, smaller, {"r": 2, "lora_alpha": 4}, "3")
        assert engine.lora.rank == 6 and _addresses(engine) == grown
        assert _gap(await _answers(engine), await _answers(merging)) <= TOL
    finally:
        merging.shutdown()
        engine.shutdown()


async def test_a_full_weight_update_serves_the_new_weights_alone(
    tiny_model_factory, tiny_model_dir: Path
) -> None:
    new_dir = tiny_model_factory("qwen2", seed=7)
    fresh = EmbeddedEngine(new_dir, **KW)
    engine = EmbeddedEngine(tiny_model_dir, max_lora_rank=4, **KW)
    try:
        await _from_tensors(engine, _adapter(engine, rank=4, seed=6), {"r": 4, "lora_alpha": 8}, "1")
        await engine.update_weights_from_disk(str(new_dir), "2", abort_all=False)
        assert await _answers(engine) == await _answers(fresh)  # bit for bit, as a merging engine does
        assert engine.lora.name is None
    finally:
        fresh.shutdown()
        engine.shutdown()


async def test_adapter_buffers_go_and_come_back_with_the_weights(tiny_model_dir: Path) -> None:
    engine = EmbeddedEngine(tiny_model_dir, max_lora_rank=4, **KW)
    try:
        await _from_tensors(engine, _adapter(engine, rank=4, seed=8), {"r": 4, "lora_alpha": 8}, "1")
        before = await _answers(engine)
        (flat,) = engine.lora.tensors()
        await engine.release_memory_occupation(["weights"])
        assert flat.untyped_storage().nbytes() == 0  # released with the weights
        await engine.resume_memory_occupation(["weights"])
        assert await _answers(engine) == before
    finally:
        engine.shutdown()


async def test_fp8_base_with_unmerged_adapters(tiny_model_dir: Path) -> None:
    fp32 = EmbeddedEngine(tiny_model_dir, max_lora_rank=4, **KW)
    engine = EmbeddedEngine(tiny_model_dir, quantization="fp8", max_lora_rank=4, **KW)
    merging = EmbeddedEngine(tiny_model_dir, quantization="fp8", lora_apply="merged", **KW)
    try:
        base = await _answers(engine)
        rec = engine.runner.served[0].q
        assert isinstance(rec, LoraWeight) and isinstance(rec.base, Fp8Weight)
        assert rec.base is engine.runner.weights[0].q  # the fp8 record a weight update requantizes
        quantized = [w.o.qweight.view(torch.uint8).clone() for w in engine.runner.weights]
        seconds = engine.stats["quantize_s"]
        adapter = _adapter(engine, rank=4, seed=9)
        for e in (fp32, engine, merging):
            await _from_tensors(e, adapter, {"r": 4, "lora_alpha": 8}, "1")
        # no requantization: the fp8 weights are the base's, the adapter runs beside them in fp32
        assert engine.stats["quantize_s"] == seconds
        for w, q in zip(engine.runner.weights, quantized, strict=True):
            assert torch.equal(w.o.qweight.view(torch.uint8), q)
        # a merging fp8 engine quantizes the merged weights instead
        assert not torch.equal(merging.runner.weights[0].o.qweight.view(torch.uint8), quantized[0])
        logits = [e.runner.extend(ExtendBatch([0], [PROMPTS[0]], [0])) for e in (fp32, engine)]
        gap = (torch.log_softmax(logits[0], -1) - torch.log_softmax(logits[1], -1)).abs().max().item()
        assert 0 < gap < 0.1, gap  # fp8's rounding of the base, as without adapters
        assert [lp for _, lp in await _answers(engine)] != [lp for _, lp in base]
        await engine.unload_lora_adapter("a")
        assert await _answers(engine) == base
    finally:
        for e in (fp32, engine, merging):
            e.shutdown()


async def test_unmerged_refuses_an_adapter_beside_no_projection(tiny_model_dir: Path) -> None:
    engine = EmbeddedEngine(tiny_model_dir, **KW)
    try:
        head = engine.model.get_output_embeddings().weight
        tensors = {
            "base_model.model.lm_head.lora_A.weight": torch.zeros(2, head.shape[1]),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(head.shape[0], 2),
        }
        with pytest.raises(EngineBadRequest, match=r"lm_head\.weight.*--lora-apply merged"):
            await _from_tensors(engine, tensors, {"r": 2, "lora_alpha": 4}, "1")
        assert engine.lora.name is None and engine.lora.rank == 0
    finally:
        engine.shutdown()


def test_engine_lora_apply_and_rank_reach_the_engines_a_run_starts() -> None:
    from agentrl.placement import engine_starter
    from agentrl.recipe import load_run_config

    run = ["model_path=/m", "data.path=/d", "env.name=math"]
    cfg = load_run_config(None, [*run, "trainer.lora.rank=8"])
    assert cfg.engine.lora_apply == "unmerged"
    args = engine_starter(cfg, "/m", 0).keywords["extra_args"]
    assert args[args.index("--lora-apply") :][:4] == ["--lora-apply", "unmerged", "--max-lora-rank", "8"]
    merged = load_run_config(None, [*run, "trainer.lora.rank=8", "engine.lora_apply=merged"])
    assert "merged" in engine_starter(merged, "/m", 0).keywords["extra_args"]
    assert "--lora-apply" not in engine_starter(load_run_config(None, run), "/m", 0).keywords["extra_args"]
