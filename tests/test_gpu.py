"""GPU tests (``python -m pytest -m gpu``, by hand on a GPU machine; CI has none).

* Two GPUs: the trainer (cuda:0) broadcasts weights to an embedded engine (the other GPU) over NCCL,
  then both ends leave the group together and promptly; and when the engine dies first, the trainer's
  leave is aborted after its timeout instead of blocking forever.
* One GPU: the converted SmolLM2 checkpoint serves on the GPU in bf16, and the trainer's π_old on the same
  tokens is within the bf16 gap.
* One GPU: the embedded engine with CUDA graphs and torch.compile: bf16 logprobs within 2e-2 of a
  teacher-forced HF forward, seeded sampling reproducible, a next turn reusing its prefix's KV.
* One GPU, bitwise: the deterministic config that once crashed, two runs at once, the same weight bytes
  and metrics; the batch-invariant ops (a row's matmul bits across row counts and tilings, the fused
  epilogue and RoPE against torch's); the batch-invariant engine in bf16 (a request alone or among 255 others,
  any slot, prefix reuse, chunked prefill); true on-policy parity (SmolLM2-135M, the Qwen2.5-0.5B shape).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch

from agentrl.embedded.launch import start_embedded_server
from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.testing.gpus import child_gpu_env
from agentrl.types import Trajectory
from agentrl.weight_sync import BroadcastGroup, WeightUpdate

pytestmark = pytest.mark.gpu


def _trainer(model_dir: Path, dtype: str = "bfloat16"):
    from _trainer_helpers import free_port

    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    return MegatronTrainer(TrainerConfig(model_path=str(model_dir), device="cuda", dtype=dtype, lr=1e-5))


async def _sample(client: EngineClient, n: int, version: int) -> list[Trajectory]:
    out = []
    for i in range(n):
        t = Trajectory(task_id=str(i), group_id="g", prompt_ids=list(range(10 + i, 40 + i)))
        r = await client.generate(t.prompt_ids, SamplingParams(max_new_tokens=24, temperature=1.0))
        t.append_model_tokens(r.output_ids, r.logprobs, version)
        t.info["weight_version"] = r.weight_version
        out.append(t)
    return out


def _gaps(trainer, trajs: list[Trajectory]) -> list[float]:
    return [
        abs(a - b)
        for t, lp in zip(trajs, trainer.compute_logprobs(trajs), strict=True)
        for a, b in zip(lp, t.rollout_logprobs, strict=True)
    ]


def _max_gap(trainer, trajs: list[Trajectory]) -> float:
    return max(_gaps(trainer, trajs))


def _random_trajs(n: int, prompt_len: int, lengths: list[int], seed: int) -> list[Trajectory]:
    """``n`` rewarded trajectories (groups of 4) of random ids below 500, response lengths drawn from
    ``lengths``."""
    import random

    rng = random.Random(seed)
    trajs = []
    for i in range(n):
        t = Trajectory(
            task_id=str(i),
            group_id=str(i // 4),
            prompt_ids=[rng.randrange(3, 500) for _ in range(prompt_len)],
        )
        k = rng.choice(lengths)
        t.append_model_tokens([rng.randrange(3, 500) for _ in range(k)], [-1.0] * k, 0)
        t.reward = rng.random()
        trajs.append(t)
    return trajs


@pytest.mark.gpus(2)
async def test_nccl_weight_sync_and_bounded_teardown(tiny_model_dir: Path) -> None:
    trainer = _trainer(tiny_model_dir)
    env = {**os.environ, **child_gpu_env(1)}
    try:
        for engine_dies_first in (False, True):
            server = start_embedded_server(tiny_model_dir, device="cuda", dtype="bfloat16", env=env)
            client = EngineClient(server.url, timeout=120)
            try:
                await trainer.connect_engines(
                    WeightUpdate("distributed", group=BroadcastGroup(backend="nccl")), client
                )
                version = await trainer.sync_weights()
                fresh = await _sample(client, 4, version)
                assert {t.info["weight_version"] for t in fresh} == {str(version)}
                assert _max_gap(trainer, fresh) <= 2e-2
                if engine_dies_first:
                    server.stop()  # the engine's end is gone without a destroy
                t0 = time.monotonic()
                clean = await trainer.disconnect_engines(timeout=20)
                took = time.monotonic() - t0
                assert clean is (not engine_dies_first)
                assert took < 60, f"leaving the group took {took:.0f} s"
            finally:
                await trainer.disconnect_engines(timeout=20)
                await client.close()
                server.stop()
    finally:
        trainer.shutdown()


async def test_smollm2_on_gpu_engine_matches_trainer(tmp_path: Path) -> None:
    from agentrl.models.pretrained import convert

    model_dir = convert("smollm2-135m-instruct")
    trainer = _trainer(model_dir)
    server = start_embedded_server(
        model_dir, device="cuda", dtype="bfloat16", extra_args=["--mem-fraction", "0.2"]
    )
    client = EngineClient(server.url, timeout=120)
    try:
        trajs = await _sample(client, 8, 0)
        assert sum(t.num_model_tokens for t in trajs) > 80
        # Two bf16 stacks of 30 layers (HF in the engine, Megatron in the trainer) round differently. On an
        # H200 the gap was mean 0.056, max 0.40 per token (fp32 agrees to 1e-4: test_pretrained.py); far
        # above the 0.5B random shape's 0.023 max, and not yet explained. These bounds catch a regression
        # past that measurement, not a target; TIS (cap 2) absorbs gaps of this size in training.
        gaps = _gaps(trainer, trajs)
        print(f"smollm2 bf16 engine vs trainer: mean {sum(gaps) / len(gaps):.4f} max {max(gaps):.4f}")
        assert sum(gaps) / len(gaps) <= 0.1
        assert max(gaps) <= 0.6
        info = await client.server_info()
        assert info[0]["peak_gpu_mem_gb"] > 0.2  # the weights alone are 0.27 GB in bf16
    finally:
        await client.close()
        server.stop()
        trainer.shutdown()


def _teacher_gap(model, prompt: list[int], output: list[int], logprobs: list[float]) -> float:
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    ref = lp[len(prompt) - 1 : -1].gather(1, torch.tensor(output, device="cuda")[:, None]).squeeze(1)
    return float((ref - torch.tensor(logprobs, device="cuda")).abs().max())


async def test_engine_graphs_and_compile_on_gpu(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    server = start_embedded_server(
        tiny_model_dir,
        device="cuda",
        dtype="bfloat16",
        timeout=600,
        extra_args=["--compile", "--warmup-len", "256", "--max-batch-size", "16"],
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda().eval()
    try:
        async with EngineClient(server.url, timeout=300) as client:
            prompts = [list(range(10 + i, 40 + 2 * i)) for i in range(12)]
            sp = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, sampling_seed=7)
            outs = await asyncio.gather(*(client.generate(p, sp) for p in prompts))
            again = await asyncio.gather(*(client.generate(p, sp) for p in prompts))
            assert [o.output_ids for o in outs] == [o.output_ids for o in again]  # same seeds, same tokens
            gaps = [
                _teacher_gap(model, p, o.output_ids, o.logprobs) for p, o in zip(prompts, outs, strict=True)
            ]
            print(f"engine (graphs + compile, bf16) vs HF teacher-forced: max gap {max(gaps):.4f}")
            assert max(gaps) <= 2e-2

            before = (await client.server_info())[0]
            turn2 = prompts[0] + outs[0].output_ids + list(range(50, 90))
            r2 = await client.generate(turn2, SamplingParams(temperature=0.0, max_new_tokens=16))
            after = (await client.server_info())[0]
            assert after["cached_tokens"] - before["cached_tokens"] >= len(prompts[0]) + 32
            assert after["prefill_tokens"] - before["prefill_tokens"] <= len(turn2) - len(prompts[0]) - 32
            assert _teacher_gap(model, turn2, r2.output_ids, r2.logprobs) <= 2e-2
    finally:
        server.stop()


def test_packed_and_chunked_trainer_paths_on_gpu(tiny_model_dir: Path) -> None:
    # bf16 on the GPU: packed micro-batches (torch's variable-length flash kernel) and the chunked LM head
    # give the padded, full-logits path's logprobs within bf16 rounding, and a train step runs on each
    trainer = _trainer(tiny_model_dir)
    try:
        trajs = _random_trajs(12, 9, [3, 10, 40, 90], seed=0)
        base = trainer.compute_logprobs(trajs)
        cfg = trainer.cfg
        for pack, chunk in ((True, None), (False, 16), (True, 16)):
            cfg.max_tokens_per_micro_batch, cfg.pack_sequences, cfg.logprob_chunk_tokens = 256, pack, chunk
            trainer.logprobs.chunk_tokens = chunk
            got = trainer.compute_logprobs(trajs)
            gap = max(abs(a - b) for x, y in zip(base, got, strict=True) for a, b in zip(x, y, strict=True))
            print(f"pack={pack} chunk={chunk}: max logprob gap vs padded full {gap:.4f}")
            assert gap <= 2e-2
            assert trainer.train_step(trajs)["tokens_per_s"] > 0
    finally:
        trainer.shutdown()


def test_compiled_logprob_kernels_equal_eager_on_gpu() -> None:
    # the torch.compile'd log-softmax / entropy kernels (compile_kernels, on by default on CUDA) give the
    # eager ones' logprobs, entropies and logits gradients on bf16 logits of a 151,936-token vocabulary
    from agentrl.trainer.logprobs import vocab_parallel_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(777, 151936, generator=g, device="cuda")).bfloat16()
    target = torch.randint(0, 151900, (777,), generator=g, device="cuda")
    w = torch.randn(2, 777, generator=g, device="cuda")
    out = []
    for compiled in (False, True):
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(x, target, 151900, compiled=compiled)
        ((lp * w[0] + ent * w[1]).sum()).backward()
        out.append((lp, ent, x.grad.float()))
    for (eager, comp), tol in zip(zip(*out, strict=True), (1e-4, 1e-4, 1e-2), strict=True):  # grads: bf16
        assert (eager - comp).abs().max().item() <= tol * max(1.0, eager.abs().max().item())
    assert out[0][2][:, 151900:].abs().max() == 0  # padded vocabulary columns get no gradient


def test_compiled_layers_match_eager_on_gpu(tiny_model_dir: Path) -> None:
    # compile_layers: the torch.compile'd transformer layers give the eager layers' logprobs (bf16 noise),
    # in one graph per layer (no graph break), and a train step runs through them
    import torch._dynamo

    from agentrl.trainer.model import compile_transformer_layers

    trainer = _trainer(tiny_model_dir)
    try:
        trajs = _random_trajs(8, 7, [5, 30, 60], seed=1)
        eager = trainer.compute_logprobs(trajs)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compile_transformer_layers(trainer.module)
        got = trainer.compute_logprobs(trajs)
        gap = max(abs(a - b) for x, y in zip(eager, got, strict=True) for a, b in zip(x, y, strict=True))
        print(f"compiled layers: max logprob gap vs eager {gap:.4f}")
        assert gap <= 2e-2
        assert not torch._dynamo.utils.counters["graph_break"], dict(
            torch._dynamo.utils.counters["graph_break"]
        )
        assert trainer.train_step(trajs)["tokens_per_s"] > 0
    finally:
        trainer.shutdown()


def test_fused_torch_adam_on_gpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    # fuse_torch_adam: a built torch AdamW switched to its fused kernel makes the multi-tensor loop's
    # updates (fp32); the megatron trainer's optimizer runs fused through steps and a checkpoint round trip
    from types import SimpleNamespace

    from agentrl.trainer.optim import fuse_torch_adam

    g = torch.Generator(device="cuda").manual_seed(0)
    init = [torch.randn(1000, generator=g, device="cuda") for _ in range(3)]
    grads = [[torch.randn(1000, generator=g, device="cuda") for _ in range(3)] for _ in range(4)]
    finals = []
    for fuse in (False, True):
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if fuse:
            assert fuse_torch_adam(SimpleNamespace(optimizer=opt)) == 1
        for step_grads in grads:
            for p, gr in zip(params, step_grads, strict=True):
                p.grad = gr.clone()
            opt.step()
        finals.append(torch.cat([p.detach() for p in params]))
    assert all(opt.state[p]["step"].is_cuda for p in params)
    assert (finals[0] - finals[1]).abs().max().item() <= 1e-6

    def inners(trainer) -> list[torch.optim.Optimizer]:
        opt = trainer.optim.optimizer
        return [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]

    def inner_groups(trainer) -> list[dict]:
        return [grp for o in inners(trainer) for grp in o.param_groups]

    def adam_steps(trainer) -> set[float]:  # each parameter's own step tensor, on the GPU
        states = [st for o in inners(trainer) for st in o.state.values()]
        assert all(st["step"].is_cuda for st in states)
        assert len({id(st["step"]) for st in states}) == len(states)
        return {float(st["step"]) for st in states}

    trainer = _trainer(tiny_model_dir)
    try:
        assert all(grp["fused"] and not grp["foreach"] for grp in inner_groups(trainer))
        trajs = _random_trajs(8, 7, [5, 30], seed=2)
        for _ in range(2):
            assert trainer.train_step(trajs)["grad_norm"] > 0
        assert adam_steps(trainer) == {2.0}
        path = trainer.save_checkpoint(tmp_path)
        trainer.load_checkpoint(path)  # megatron's parameter-state load, with torch Adam's step tensors
        assert all(grp["fused"] for grp in inner_groups(trainer))
        assert adam_steps(trainer) == {2.0}
        m = trainer.train_step(trajs)
        assert m["grad_norm"] > 0 and m["optimizer_steps"] == 3
        assert adam_steps(trainer) == {3.0}
    finally:
        trainer.shutdown()


# ---------------------------------------------------------------- bitwise on a GPU (batch invariance, parity)
DETERMINISTIC_GPU = """output_dir: {out}
steps: 3
deterministic: true
placement: colocated
weight_sync: disk
engine: {{device: cuda, dtype: bfloat16}}
rollout: {{group_size: 4, batch_size: 4, max_staleness: 1, max_concurrency: 32, max_turns: 3,
          max_total_tokens: 600, sampling: {{temperature: 1.0, max_new_tokens: 24}},
          eval_sampling: {{temperature: 0.0, max_new_tokens: 24}},
          verifier: "agentrl.testing.verifiers:length_parity", filter_zero_variance: true}}
trainer: {{device: cuda, dtype: bfloat16, lr: 1.0e-3, micro_batch_size: 8}}
eval: {{num_tasks: 8}}
"""


def test_two_deterministic_gpu_runs_at_once_are_bit_identical(tmp_path: Path) -> None:
    """The deterministic config that crashed on a GPU (the compiled warmup prefilled a second row into a
    one-slot KV cache: a device-side assert): two runs at once on one GPU end with the same bytes in every
    weight and the same metrics, timings apart."""
    import json
    import subprocess
    import sys

    from agentrl.metrics import read_metrics, without_timings
    from agentrl.testing.configs import TINY_SEARCH_R1

    root = Path(__file__).resolve().parent.parent
    procs = {}
    for name in ("a", "b"):
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(
            (TINY_SEARCH_R1 + DETERMINISTIC_GPU).format(out=tmp_path / name, cache=tmp_path / f"cache_{name}")
        )
        log = open(tmp_path / f"{name}.log", "w")
        procs[name] = (
            subprocess.Popen(
                [sys.executable, "train_async.py", "--config", str(cfg)],
                cwd=root,
                stdout=log,
                stderr=subprocess.STDOUT,
            ),
            log,
        )
    for name, (proc, log) in procs.items():
        rc = proc.wait(timeout=900)
        log.close()
        assert rc == 0, (tmp_path / f"{name}.log").read_text()[-6000:]
    # timings, the engine's batching counters and the prefix-cache hits read from them, memory peaks: how
    # requests were batched may vary with timing, what they produced may not
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip() / "rank_00000.pt"
        weights = torch.load(ckpt, map_location="cpu", weights_only=False)["model"]
        rows = [without_timings(r) for r in read_metrics(out / "metrics.jsonl")]
        runs.append((weights, rows))
    (wa, ma), (wb, mb) = runs
    tensors = [k for k, v in wa.items() if isinstance(v, torch.Tensor)]
    assert tensors and wa.keys() == wb.keys()
    for k in tensors:
        assert (
            wa[k].contiguous().view(torch.uint8).numpy().tobytes()
            == wb[k].contiguous().view(torch.uint8).numpy().tobytes()
        ), k
    assert json.dumps(ma, sort_keys=True) == json.dumps(mb, sort_keys=True)
    assert [r["policy_version"] for r in ma if "policy_version" in r] == [1, 2, 3]


def test_batch_invariant_ops_on_gpu_bf16() -> None:
    """The Triton ops in bf16: a row's matmul bits do not depend on the row count across the tilings chosen
    by it (the Qwen2.5-0.5B shape's projections and LM head, 1..600 rows and more), every tiling agrees on
    this GPU, the fused bias/residual epilogue equals torch's adds after the product, a fused projection's
    columns equal the separate projections', and the fused RoPE and SwiGLU equal torch's formulas, bit for
    bit, from strided inputs and shared tables too."""
    from agentrl import batch_invariant as bi
    from agentrl.batch_invariant import triton_ops as tri

    dev, dt = torch.device("cuda"), torch.bfloat16
    assert tri.tilings_agree(dev, dt), "the tilings' bits differ on this GPU: every matmul takes one tiling"
    g = torch.Generator(device=dev).manual_seed(0)
    for k, n in ((896, 896), (896, 128), (896, 4864), (4864, 896), (896, 151936)):
        a = torch.randn(4096, k, device=dev, dtype=dt, generator=g)
        w = torch.randn(n, k, device=dev, dtype=dt, generator=g) / k**0.5
        full = tri.matmul(a, w)
        moved = [m for m in (*range(1, 601), 1000, 4095) if not torch.equal(tri.matmul(a[:m], w), full[:m])]
        assert not moved, (k, n, moved[:10])
        b = torch.randn(n, device=dev, dtype=dt, generator=g)
        r = torch.randn(4096, n, device=dev, dtype=dt, generator=g)
        for m in (64, 4096):
            assert torch.equal(tri.matmul(a[:m], w, b, r[:m]), r[:m] + (full[:m] + b))
    x = torch.randn(3, 70, 14, 64, device=dev, dtype=dt, generator=g)
    cos, sin = bi.rope_tables(1.0 / (1e6 ** (torch.arange(0, 64, 2).float() / 64)), 70, dev, dt)
    half = 32
    want = x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]
    assert torch.equal(bi.rope(x, cos, sin), want)  # [s, d] tables for [b, s] tokens: read every s rows
    pos = torch.arange(70, device=dev).expand(3, 70)
    assert torch.equal(bi.rope(x, cos[pos], sin[pos]), want)  # one table row per token (the engine's)
    strided = torch.randn(3, 70, 2, 9, 64, device=dev, dtype=dt, generator=g)[
        ..., 7, :
    ]  # a key of a fused qkv
    assert torch.equal(bi.rope(strided, cos, sin), bi.rope(strided.contiguous(), cos, sin))
    xr = x.detach().requires_grad_()
    gy = torch.randn_like(x)
    (got,) = torch.autograd.grad(bi.rope(xr, cos, sin), xr, gy)
    xf = x.float().requires_grad_()
    rot = xf * cos[:, None].float() + torch.cat((-xf[..., half:], xf[..., :half]), -1) * sin[:, None].float()
    (ref,) = torch.autograd.grad(rot, xf, gy.float())
    assert torch.allclose(got.float(), ref, rtol=1e-2, atol=1e-2)
    # megatron's fused projections (qkv per KV group; [gate; up]) give each column the bits of its own
    # projection, and SwiGLU reads the halves in place
    a = torch.randn(4096, 896, device=dev, dtype=dt, generator=g)
    for n, parts in (
        (1152, [range(0, 448), range(448, 512), range(512, 576)]),
        (9728, [range(0, 4864), range(4864, 9728)]),
    ):
        w = torch.randn(n, 896, device=dev, dtype=dt, generator=g) / 30
        for m in (1, 64, 4096):
            fused = tri.matmul(a[:m], w)
            for cols in parts:
                idx = torch.tensor(list(cols), device=dev)
                assert torch.equal(fused[:, idx], tri.matmul(a[:m], w[idx])), (n, m, cols)
    gu = torch.randn(3, 70, 9728, device=dev, dtype=dt, generator=g)
    gate, up = gu[..., :4864], gu[..., 4864:]
    assert torch.equal(bi.silu_mul(gate, up), bi.silu_mul(gate.contiguous(), up.contiguous()))
    assert torch.equal(bi.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)


async def test_batch_invariant_engine_on_gpu_bf16(tiny_model_factory) -> None:
    """bf16 with CUDA graphs: a request's tokens and logprobs are the same bits alone or among 255 others
    at any slot, with prefix reuse and 16-token prefill chunks (Triton kernels of agentrl.batch_invariant)."""
    import random

    from agentrl.embedded.engine import EmbeddedEngine
    from agentrl.embedded.sampling import RequestSampling

    model = tiny_model_factory(
        "qwen3",
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        dtype="bfloat16",
    )
    rng = random.Random(0)
    mine = [rng.randrange(3, 600) for _ in range(70)]
    others = [[rng.randrange(3, 600) for _ in range(rng.randrange(5, 150))] for _ in range(255)]

    def sp(seed: int) -> RequestSampling:
        return RequestSampling(temperature=1.0, max_new_tokens=16, sampling_seed=seed, ignore_eos=True)

    def engine(**kw) -> EmbeddedEngine:
        return EmbeddedEngine(
            model,
            device="cuda",
            dtype="bfloat16",
            max_batch_size=256,
            batch_invariant=True,
            context_len=1024,
            memory_mode="copy",
            **kw,
        )

    e = engine(prefix_cache_slots=0)
    assert e.warmup(64) > 0  # decode graphs, and the Triton kernels' prefill variants (it writes slots 0..79)
    alone = await e.generate(mine, sp(7), "alone")
    for pos in (0, 100, 255):
        batch = [*others[:pos], mine, *others[pos:]]
        recs = await asyncio.gather(
            *(e.generate(p, sp(7 if p is mine else 1000 + i), f"c{pos}-{i}") for i, p in enumerate(batch))
        )
        assert recs[pos].output_ids == alone.output_ids and recs[pos].logprobs == alone.logprobs, pos
    e.shutdown()
    e = engine(prefix_cache_slots=8, max_prefill_tokens=16)
    await e.generate([*mine[:48], 5, 6, 7], sp(3), "prefix")
    recs = await asyncio.gather(
        *(
            e.generate(p, sp(7 if p is mine else 1000 + i), f"r{i}")
            for i, p in enumerate([*others[:40], mine])
        )
    )
    assert recs[-1].cached_tokens >= 48
    assert recs[-1].output_ids == alone.output_ids and recs[-1].logprobs == alone.logprobs
    e.shutdown()


def _qwen05b_shape(out: Path) -> Path:
    """A randomly initialised model of Qwen2.5-0.5B's shape (bf16), with the tiny model's tokenizer."""
    import shutil

    import transformers

    from agentrl.models.tiny import QWEN25_05B, build_tiny_model

    build_tiny_model(out / "tok", arch="qwen2")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**QWEN25_05B, eos_token_id=2, pad_token_id=0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (out / "tok" / f).exists():
            shutil.copy(out / "tok" / f, out / f)
    return out


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-0.5b-shape"])
async def test_true_on_policy_on_gpu_bf16(model: str, tmp_path: Path) -> None:
    """trainer.true_on_policy in bf16: the trainer's logprobs equal the batch-invariant engine's bit for bit
    on two-turn episodes run concurrently (prefix reuse on), before and after a weight update: mismatch KL
    0, max |Δ log p| 0, PPO-KL 0, TIS weights 1."""
    import json

    from _trainer_helpers import free_port

    from agentrl.embedded.engine import EmbeddedEngine
    from agentrl.embedded.sampling import RequestSampling
    from agentrl.models.pretrained import convert

    model_dir = (
        convert("smollm2-135m-instruct") if model == "smollm2-135m" else _qwen05b_shape(tmp_path / "m")
    )
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.losses import LossConfig
    from agentrl.trainer.trainer import MegatronTrainer

    trainer = MegatronTrainer(
        TrainerConfig(
            model_path=str(model_dir),
            device="cuda",
            dtype="bfloat16",
            lr=1e-5,
            micro_batch_size=4,
            true_on_policy=True,
            old_logprobs="recompute",
            loss=LossConfig(tis="token"),
        )
    )
    engine = EmbeddedEngine(
        model_dir,
        device="cuda",
        dtype="bfloat16",
        max_batch_size=16,
        batch_invariant=True,
        context_len=1024,
        mem_fraction=0.3,
        memory_mode="copy",
    )

    async def episode(i: int, version: int, seed: int) -> Trajectory:
        prompt = [(seed * 7919 + i * 104729 + j * 31) % 900 + 3 for j in range(40 + 3 * i)]
        t = Trajectory(task_id=f"t{i}", group_id=f"g{i // 4}", prompt_ids=prompt)
        s1 = RequestSampling(temperature=1.0, max_new_tokens=24, sampling_seed=seed + i, ignore_eos=True)
        r = await engine.generate(prompt, s1, f"{seed}-{i}-a")
        t.append_model_tokens(r.output_ids, r.logprobs, version)
        t.append_observation_tokens([11, 12, 13, 14, 15])
        s2 = RequestSampling(temperature=1.0, max_new_tokens=16, sampling_seed=seed + 50 + i, ignore_eos=True)
        r2 = await engine.generate(t.input_ids, s2, f"{seed}-{i}-b")
        t.append_model_tokens(r2.output_ids, r2.logprobs, version)
        t.reward = float(i % 2)
        return t

    try:
        for step in range(2):
            trajs = list(await asyncio.gather(*(episode(i, step, 100 * step) for i in range(12))))
            gaps = [
                abs(a - b)
                for t, lp in zip(trajs, trainer.compute_logprobs(trajs), strict=True)
                for a, b, m in zip(lp, t.rollout_logprobs, t.loss_mask, strict=True)
                if m
            ]
            m = trainer.train_step(trajs)
            keys = ("mismatch_kl", "mismatch_logprob_abs_diff_max", "ppo_kl", "tis_weight_mean")
            row = {"model": model, "step": step, "tokens": len(gaps), "max_gap": max(gaps)}
            print(json.dumps({**row, **{k: m[k] for k in keys}}))
            assert max(gaps) == 0.0
            assert m["mismatch_kl"] == 0.0 and m["mismatch_logprob_abs_diff_max"] == 0.0
            assert m["ppo_kl"] == 0.0 and m["tis_weight_mean"] == 1.0
            trainer.save_hf(tmp_path / f"w{step}")
            await engine.update_weights_from_disk(str(tmp_path / f"w{step}"), str(step + 1), abort_all=False)
            trainer.policy_version += 1
    finally:
        engine.shutdown()
        trainer.shutdown()
