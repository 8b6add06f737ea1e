"""Real SGLang, launched by agentrl's launcher and driven by its client (``python -m pytest -m gpu
tests/test_gpu_sglang.py``; SGLang from ``scripts/gpu_setup.sh --sglang`` or the ``sglang`` extra).

* Token-in/token-out over two turns: the ids sent are the ids SGLang continues, the second turn reuses the
  first turn's prefix (radix cache), and the logprobs returned are the raw model's (what the trainer
  recomputes; a float32 HF forward of the same weights), not the temperature-scaled ones.
* ``/release_memory_occupation`` and ``/resume_memory_occupation`` by tag (``--enable-memory-saver``): the
  KV cache's memory goes back to the driver and returns; weights released without a CPU backup come back
  right once new ones are pushed.
* A request interrupted by a weight update (pause in abort mode, ``/update_weights_from_tensor`` with
  CUDA IPC handles packed by agentrl, which never imports sglang) is resubmitted with its tokens and
  continues under the new weights: nothing of the old weights' KV cache is reused.
* ``/init_weights_update_group`` + ``/update_weights_from_distributed``: NCCL with the trainer on GPU 0
  and the server on GPU 1 when there are two GPUs, gloo on one GPU.
* fp8 (``quantization: fp8``, which the launcher pairs with ``--load-format flash_rl``): bf16 weights pushed
  with agentrl's tensor sync are quantized again, so the served logprobs follow the new weights.
* NGRAM speculative decoding (no draft model): drafts accepted, the emitted tokens' logprobs the served
  model's raw ones, and the colocated tensor sync works with it on.
* LoRA (``lora``: ``--enable-lora`` and its room): an agentrl LoRA trainer syncs its adapters twice
  (``agentrl-v1``, ``agentrl-v2``, each loaded from the request, the previous one unloaded); a client that
  looks the adapter up as the rollout's does serves the adapted model (a float32 forward of base + adapter);
  requests that name no adapter still get the base model, unchanged: no full weight update happened. Once
  with every target module, once with targets that are parts of SGLang's fused layers (completed by the
  sync).
* Mixture of experts (``return_routed_experts``): the routing a server reports for routing replay is its
  model's, for every position of a request, a cached prefix included.

The model is a small random Qwen2 (4 layers, hidden 256, head dim 64, bf16) with a large initializer
range, so that its next-token distributions are peaked and a temperature, or a stale weight, shows. SGLang
serves it in bf16; the reference is a float32 forward of the same weights, so logprobs agree to about
0.1 nats on average, while the wrong distribution is off by several times that.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import statistics
from pathlib import Path

import pytest
import torch

from agentrl.engine.adapters import adapter_name
from agentrl.engine.client import EngineClient
from agentrl.engine.launcher import SGLangConfig, SGLangLauncher, SGLangLoRAConfig
from agentrl.engine.types import SamplingParams
from agentrl.testing.gpus import child_gpu_env
from agentrl.weight_sync import WeightUpdate
from agentrl.weight_sync.tensor import push_tensors

pytestmark = [pytest.mark.gpu, pytest.mark.sglang, pytest.mark.usefixtures("sglang_required")]

SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.15,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two models of one shape: A (what the server loads) and B (the weights pushed to it)."""
    from agentrl.models.tiny import build_tiny_model

    return tuple(
        build_tiny_model(
            tmp_path_factory.mktemp(f"sglang_model_{s}"), arch="qwen2", seed=s, dtype="bfloat16", **SHAPE
        )
        for s in (0, 1)
    )


_HF: dict[Path, torch.nn.Module] = {}


def _hf(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    return _HF[model_dir]


@torch.no_grad()
def reference_logprobs(model_dir: Path, ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= start, float32 forward of the (bf16) weights at ``temperature``."""
    logits = _hf(model_dir)(torch.tensor([ids], device="cuda")).logits[0].float() / temperature
    lp = torch.log_softmax(logits[start - 1 : len(ids) - 1], dim=-1)
    return lp.gather(1, torch.tensor(ids[start:], device="cuda")[:, None])[:, 0].tolist()


def hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model's HF-named weights on the GPU (bf16), as the trainer hands them over."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return {k: v.cuda() for k, v in model.state_dict().items()}


def gaps(got: list[float], want: list[float]) -> list[float]:
    assert len(got) == len(want)
    return [abs(a - b) for a, b in zip(got, want, strict=True)]


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]  # within the tiny tokenizer's vocabulary


def server_config(
    model: Path, log: Path | None, mem_fraction: float, extra_args: dict | None = None, **fields
) -> SGLangConfig:
    """A test server's config: ``model`` at ``mem_fraction`` of the GPU, any free port, CUDA graphs for up
    to 8 rows, 15 minutes to start, its output in ``log``; ``fields``: the test's own settings."""
    return SGLangConfig(
        model_path=str(model),
        port=0,
        mem_fraction_static=mem_fraction,
        extra_args={"cuda-graph-max-bs": 8, **(extra_args or {})},
        startup_timeout=900,
        log_file=None if log is None else str(log),
        **fields,
    )


def _served(cfg: SGLangConfig, log: Path):
    """A started server; what it said before it went away, printed if it died."""
    with SGLangLauncher(cfg) as launcher:
        yield launcher
        if not launcher.healthy():
            print(
                f"--- SGLang died; last lines of {log} ---\n" + "\n".join(log.read_text().splitlines()[-60:])
            )


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("sglang_log") / "sglang.log"
    cfg = server_config(models[0], log, 0.3, memory_saver=True)
    yield from _served(cfg, log)


async def test_token_in_token_out_multi_turn(server: SGLangLauncher, models: tuple[Path, Path]) -> None:
    prompt = ids(48, seed=1)
    sp = SamplingParams(temperature=0.7, max_new_tokens=24, ignore_eos=True, sampling_seed=7)
    async with EngineClient(server.url, timeout=300) as client:
        r1 = await client.generate(prompt, sp)
        observation = ids(6, seed=2)
        turn2 = prompt + r1.output_ids + observation
        r2 = await client.generate(turn2, sp)
        info = (await client.server_info())[0]
    assert len(r1.output_ids) == len(r1.logprobs) == 24 and r1.finish_reason == "length"
    assert len(r2.output_ids) == len(r2.logprobs) == 24 and r2.prompt_tokens == len(turn2)
    assert r2.meta["cached_tokens"] >= len(prompt)  # the second turn continued the first turn's cached prefix
    got = r1.logprobs + r2.logprobs
    raw = reference_logprobs(models[0], prompt + r1.output_ids, len(prompt))
    raw += reference_logprobs(models[0], turn2 + r2.output_ids, len(turn2))
    scaled = reference_logprobs(models[0], prompt + r1.output_ids, len(prompt), temperature=0.7)
    scaled += reference_logprobs(models[0], turn2 + r2.output_ids, len(turn2), temperature=0.7)
    to_raw, to_scaled = gaps(got, raw), gaps(got, scaled)
    print(
        f"SGLang {info.get('version')} attention {info.get('attention_backend')} sampling "
        f"{info.get('sampling_backend')}: |d logp| to the raw model mean {statistics.mean(to_raw):.4f} max "
        f"{max(to_raw):.4f}; to the T=0.7 distribution mean {statistics.mean(to_scaled):.4f}"
    )
    assert info.get("attention_backend") == "triton" and info.get("sampling_backend") == "pytorch"
    assert statistics.mean(to_raw) < 0.15  # bf16 serving against a float32 forward of the same weights
    assert statistics.mean(to_raw) < 0.5 * statistics.mean(to_scaled)  # the raw model's, not the scaled


async def test_release_and_resume_memory_by_tag(server: SGLangLauncher, models: tuple[Path, Path]) -> None:
    prompt = ids(40, seed=3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    free = lambda: torch.cuda.mem_get_info()[0] / 2**30  # noqa: E731 - the device's, seen from this process
    total = torch.cuda.mem_get_info()[1] / 2**30
    async with EngineClient(server.url, timeout=300) as client:
        before = await client.generate(prompt, greedy)
        awake = free()
        await client.release_memory_occupation(["kv_cache"])
        kv_released = free()
        await client.resume_memory_occupation(["kv_cache"])
        after_kv = await client.generate(prompt, greedy)
        resumed = free()
        await client.release_memory_occupation()  # everything: KV cache, weights, CUDA graphs
        all_released = free()
        await client.resume_memory_occupation()
        # no --enable-weights-cpu-backup: the weights come back as garbage until new ones are pushed
        await push_tensors(client, hf_weights(models[0]), weight_version=0)
        after_push = await client.generate(prompt, greedy)
    print(
        f"free GiB: awake {awake:.1f}, KV cache released {kv_released:.1f}, all released {all_released:.1f}"
    )
    assert kv_released - awake > 0.5 * 0.3 * total  # most of the 0.3 share is KV cache, and it went back
    assert abs(resumed - awake) < 0.05 * total
    assert all_released >= kv_released - 0.5
    assert after_kv.output_ids == before.output_ids  # weights kept; the KV cache recomputed
    assert after_push.output_ids == before.output_ids
    assert max(gaps(after_push.logprobs, before.logprobs)) < 1e-3


async def test_update_interrupts_and_recomputes_without_stale_kv(
    server: SGLangLauncher, models: tuple[Path, Path]
) -> None:
    """What the rollout does around a weight update, on real SGLang: pause (abort mode) returns the
    in-flight request with the tokens so far; the update (flush_cache) drops the radix cache; the request
    is resubmitted with its tokens and continues under the new weights, its prefix recomputed."""
    prompt = ids(32, seed=4)
    long = SamplingParams(temperature=1.0, max_new_tokens=3000, ignore_eos=True)
    async with EngineClient(server.url, timeout=300) as client:
        flight = asyncio.create_task(client.generate(prompt, long))
        await asyncio.sleep(1.0)
        await client.pause(mode="abort")
        first = await flight
        await push_tensors(client, hf_weights(models[1]), weight_version=1)
        await client.continue_generation()
        seq = prompt + first.output_ids
        second = await client.generate(
            seq, SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
        )
    assert first.finish_reason == "abort" and 0 < len(first.output_ids) < 3000, first.finish_reason
    assert second.weight_version == "1"
    assert second.meta["cached_tokens"] == 0  # nothing reused from the old weights' KV cache
    before = gaps(first.logprobs, reference_logprobs(models[0], seq, len(prompt)))
    under_new = gaps(second.logprobs, reference_logprobs(models[1], seq + second.output_ids, len(seq)))
    under_old = gaps(second.logprobs, reference_logprobs(models[0], seq + second.output_ids, len(seq)))
    print(
        f"interrupted after {len(first.output_ids)} tokens; |d logp| before the update to A "
        f"{statistics.mean(before):.4f}, after it to B {statistics.mean(under_new):.4f} (to A "
        f"{statistics.mean(under_old):.4f})"
    )
    assert statistics.mean(before) < 0.15 and statistics.mean(under_new) < 0.15  # bf16 against float32
    assert statistics.mean(under_old) > 4 * statistics.mean(under_new)  # B's, not A's (nor a mix)


@pytest.mark.gpus(2, at_least=1)
@pytest.mark.xdist_group("sglang_distributed")  # its own server, apart from the module's shared one
async def test_distributed_weight_update(models: tuple[Path, Path]) -> None:
    """SGLang's distributed update protocol (``/init_weights_update_group``,
    ``/update_weights_from_distributed``, ``/destroy_weights_update_group``) against agentrl's trainer side:
    NCCL from GPU 0 to a server on GPU 1 when there are two GPUs (an NCCL group cannot hold two processes of
    one GPU), else gloo on one GPU (the same requests and broadcasts). Afterwards the server answers as the
    broadcast weights do.

    This end runs with SGLang's NCCL setting (:data:`~agentrl.weight_sync.SGLANG_PEER_ENV`). NCCL reads it
    once per process, at its first communicator, and earlier tests of the process (an in-process trainer,
    test_gpu.py's NCCL sync) make communicators: so tests/conftest.py sets it when the process starts. Set
    here it would come too late, and the update fail with "Cuda failure 'invalid argument'". A failed
    update leaves this end's broadcast blocked in NCCL: it runs in a daemon thread, which neither the event
    loop's close nor the interpreter's exit waits for, and the group is aborted, so that the tests after it
    do not stall."""
    from agentrl.engine.dist import (
        host_store,
        in_daemon_thread,
        init_custom_process_group,
        leave_process_group,
    )
    from agentrl.weight_sync import SGLANG_PEER_ENV

    two = torch.cuda.device_count() >= 2
    backend = "nccl" if two else "gloo"
    for key, value in SGLANG_PEER_ENV.items():
        assert os.environ.get(key) == value, f"{key}={os.environ.get(key)}: NCCL here must run as SGLang's"
    torch.cuda.set_device(0)
    cfg = server_config(models[0], None, 0.3, env=child_gpu_env(1) if two else {})
    weights = hf_weights(models[1])
    names = list(weights)
    prompt = ids(40, seed=5)
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    pg = None
    with SGLangLauncher(cfg) as launcher:
        async with EngineClient(launcher.url, timeout=300) as client:
            store = host_store(2, 120.0)  # held from here on: no other process can take the port meanwhile
            try:
                _, pg = await asyncio.gather(
                    client.init_weights_update_group("127.0.0.1", store.port, 1, 2, "agentrl_test", backend),
                    in_daemon_thread(
                        functools.partial(init_custom_process_group, store=store),
                        backend,
                        f"tcp://127.0.0.1:{store.port}",
                        2,
                        0,
                        "agentrl_test",
                        120.0,
                    ),  # the NCCL communicator comes at the first broadcast, as SGLang's end makes its own
                )

                def broadcast() -> None:
                    for n in names:
                        torch.distributed.broadcast(weights[n], src=0, group=pg)
                    torch.cuda.synchronize()

                await asyncio.gather(
                    client.update_weights_from_distributed(
                        names,
                        [str(weights[n].dtype) for n in names],
                        [list(weights[n].shape) for n in names],
                        "agentrl_test",
                        weight_version="1",
                    ),
                    in_daemon_thread(broadcast),  # blocked for good if the server failed: left behind
                )
                out = await client.generate(prompt, sp)
                left = await asyncio.gather(
                    client.destroy_weights_update_group("agentrl_test"), leave_process_group(pg)
                )
                pg = None
            finally:
                if pg is not None:  # failed midway: abort this end (the server goes with the launcher)
                    await leave_process_group(pg, timeout=10)
    assert out.weight_version == "1"
    assert left[1], "the trainer's end of the group had to be aborted"
    got = gaps(out.logprobs, reference_logprobs(models[1], prompt + out.output_ids, len(prompt)))
    old = gaps(out.logprobs, reference_logprobs(models[0], prompt + out.output_ids, len(prompt)))
    print(
        f"{backend}: |d logp| to the broadcast weights "
        f"{statistics.mean(got):.4f}, to the old {statistics.mean(old):.4f}"
    )
    assert statistics.mean(got) < 0.15 and statistics.mean(old) > 4 * statistics.mean(got)


@pytest.mark.xdist_group("sglang_fp8")  # its own server: a worker of its own may run it meanwhile
async def test_fp8_update_is_quantized_again(models: tuple[Path, Path], tmp_path: Path) -> None:
    """``quantization: fp8`` on a bf16 checkpoint: the launcher adds ``--load-format flash_rl``, whose loader
    quantizes weights pushed later again (plain ``--quantization fp8`` only quantizes at load; see
    docs/guide/fp8-rollout.md). After a push of B's bf16 weights with agentrl's tensor sync the server
    serves B: its logprobs are as close to a float32 forward of B as they were to A's before the push
    (fp8's own error), and far from A's."""
    log = tmp_path / "sglang_fp8.log"
    cfg = server_config(models[0], log, 0.2, quantization="fp8")
    prompt = ids(40, seed=7)
    sp = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True, sampling_seed=11)
    with SGLangLauncher(cfg) as launcher:
        async with EngineClient(launcher.url, timeout=300) as client:
            info = (await client.server_info())[0]
            first = await client.generate(prompt, sp)
            await push_tensors(client, hf_weights(models[1]), weight_version=1)
            second = await client.generate(prompt, sp)
    assert info.get("quantization") == "fp8" and info.get("load_format") == "flash_rl", info
    before = gaps(first.logprobs, reference_logprobs(models[0], prompt + first.output_ids, len(prompt)))
    seq = prompt + second.output_ids
    under_new = gaps(second.logprobs, reference_logprobs(models[1], seq, len(prompt)))
    under_old = gaps(second.logprobs, reference_logprobs(models[0], seq, len(prompt)))
    print(
        f"fp8: |d logp| to A before the push {statistics.mean(before):.4f}; after it to B "
        f"{statistics.mean(under_new):.4f}, to A {statistics.mean(under_old):.4f}"
    )
    assert second.weight_version == "1"
    # B's fp8 error is of the size of A's (2x and 0.05 nats of room for two sets of sampled tokens)
    assert statistics.mean(under_new) < 2 * statistics.mean(before) + 0.05
    assert statistics.mean(under_old) > 4 * statistics.mean(under_new)  # B's, not A's (nor a mix)


@pytest.mark.xdist_group("sglang_ngram")  # its own server: a worker of its own may run it meanwhile
async def test_ngram_speculation_keeps_target_logprobs_across_an_update(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """SGLang's own speculative decoding without a draft model (``--speculative-algorithm NGRAM``, passed
    through ``engine.sglang.extra_args``; docs/guide/speculative-decoding.md). On a prompt that repeats
    itself, asked twice (the second time its n-gram cache holds the first answer), drafts are accepted
    (fewer verify steps than tokens); every emitted token's logprob is the served model's raw one (a
    float32 forward at temperature 1, not at the sampling temperature), greedy and sampled; and a push of
    B's weights with agentrl's tensor sync (the colocated path, ``/update_weights_from_tensor``) succeeds
    with speculation on, after which the server answers as B."""
    log = tmp_path / "sglang_ngram.log"
    ngram = {"speculative-algorithm": "NGRAM", "speculative-num-draft-tokens": 4}
    cfg = server_config(models[0], log, 0.2, ngram)
    prompt = ids(16, seed=9) * 4
    greedy = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    hot = SamplingParams(temperature=0.7, max_new_tokens=48, ignore_eos=True, sampling_seed=3)
    with SGLangLauncher(cfg) as launcher:
        async with EngineClient(launcher.url, timeout=300) as client:
            info = (await client.server_info())[0]
            first = await client.generate(prompt, greedy)
            again = await client.generate(prompt, greedy)
            sampled = await client.generate(prompt, hot)
            await push_tensors(client, hf_weights(models[1]), weight_version=1)
            after = await client.generate(prompt, hot)
    raw = {
        name: statistics.mean(
            gaps(out.logprobs, reference_logprobs(models[0], prompt + out.output_ids, len(prompt)))
        )
        for name, out in (("greedy", first), ("greedy again", again), ("sampled", sampled))
    }
    scaled = statistics.mean(
        gaps(sampled.logprobs, reference_logprobs(models[0], prompt + sampled.output_ids, len(prompt), 0.7))
    )
    seq = prompt + after.output_ids
    under_new = statistics.mean(gaps(after.logprobs, reference_logprobs(models[1], seq, len(prompt))))
    under_old = statistics.mean(gaps(after.logprobs, reference_logprobs(models[0], seq, len(prompt))))
    verify = {name: out.meta.get("spec_verify_ct") for name, out in (("first", first), ("again", again))}
    print(
        f"NGRAM: server speculative_algorithm={info.get('speculative_algorithm')}; verify steps for 48 "
        f"tokens {verify}; same greedy tokens twice: {first.output_ids == again.output_ids}; |d logp| to "
        f"A raw {raw}, sampled to A at temperature 0.7 {scaled:.4f}; after the push to B "
        f"{under_new:.4f}, to A {under_old:.4f}; meta keys {sorted(again.meta)}"
    )
    assert str(info.get("speculative_algorithm")).upper() == "NGRAM", info.get("speculative_algorithm")
    assert verify["again"] is not None and 0 < verify["again"] < len(again.output_ids), verify
    assert all(v < 0.15 for v in raw.values()), raw  # bf16 against float32, the raw distribution
    assert scaled > 2 * raw["sampled"]  # not the temperature-scaled logprobs
    assert after.weight_version == "1"
    assert under_new < 0.15 and under_old > 4 * under_new  # B's, not A's (nor a mix)


MOE_SHAPE = {**SHAPE, "num_experts": 8, "num_experts_per_tok": 2}


@torch.no_grad()
def reference_routing(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """``[len(ids), layers, k]``: the experts a float32 forward of the (bf16) weights routes each position
    to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    logits = model(torch.tensor([ids], device="cuda"), output_router_logits=True).router_logits
    k = MOE_SHAPE["num_experts_per_tok"]
    return torch.stack([layer.float().topk(k, dim=-1).indices for layer in logits], dim=1).cpu()


def routing_agreement(record: str, want: torch.Tensor) -> float:
    """The share of (position, layer) pairs whose recorded expert set equals ``want``'s."""
    from agentrl.models.moe import decode_routed_experts

    got = torch.from_numpy(decode_routed_experts(record, want.shape[1], want.shape[2]).copy())
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got.sort(-1).values == want.sort(-1).values).all(-1).float().mean().item()


@pytest.mark.xdist_group("sglang_moe")  # its own server: a worker of its own may run it meanwhile
async def test_moe_server_reports_the_routing_replay_trains_with(tmp_path: Path) -> None:
    """Routing replay's input from SGLang (``return_routed_experts``, which a run with
    ``trainer.moe.routing_replay`` sets): a Qwen3-MoE server returns, for a request that asks, the experts
    of every position but the last (base64 int32 ``[positions, layers, k]``, agentrl's decoder), those a
    float32 forward of its weights routes to (bf16 serving flips a few near ties), not another model's; a
    second turn whose prefix came from the cache still reports every position; a request that does not
    ask gets none."""
    from agentrl.models.tiny import build_tiny_model

    served, other = (
        build_tiny_model(tmp_path / f"moe_{s}", arch="qwen3_moe", seed=s, dtype="bfloat16", **MOE_SHAPE)
        for s in (0, 1)
    )
    log = tmp_path / "sglang_moe.log"
    cfg = server_config(served, log, 0.2, return_routed_experts=True)
    prompt = ids(40, seed=13)
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, sampling_seed=5)
    with SGLangLauncher(cfg) as launcher:
        async with EngineClient(launcher.url, timeout=300) as client:
            first = await client.generate(prompt, sp, return_routed_experts=True)
            turn2 = prompt + first.output_ids + ids(6, seed=14)
            second = await client.generate(turn2, sp, return_routed_experts=True)
            unasked = await client.generate(prompt, sp)
    seq1, seq2 = prompt + first.output_ids, turn2 + second.output_ids
    agree = routing_agreement(first.meta["routed_experts"], reference_routing(served, seq1)[:-1])
    agree2 = routing_agreement(second.meta["routed_experts"], reference_routing(served, seq2)[:-1])
    other_model = routing_agreement(first.meta["routed_experts"], reference_routing(other, seq1)[:-1])
    print(
        f"SGLang routed experts: agreement with a float32 forward {agree:.3f} (second turn, cached "
        f"prefix {second.meta.get('cached_tokens')} tokens: {agree2:.3f}); with another model's routing "
        f"{other_model:.3f}"
    )
    assert second.meta.get("cached_tokens", 0) >= len(prompt)
    assert agree >= 0.9 and agree2 >= 0.9
    assert other_model < 0.5
    assert unasked.meta.get("routed_experts") is None


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK, LORA_ALPHA = 8, 16.0


@pytest.fixture(scope="module")
def lora_server(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    """SGLang with LoRA serving on, room for rank-8 adapters on every module the trainer adapts."""
    log = tmp_path_factory.mktemp("sglang_lora_log") / "sglang.log"
    cfg = server_config(models[0], log, 0.2, lora=SGLangLoRAConfig.for_adapters(LORA_RANK, ALL_TARGETS))
    yield from _served(cfg, log)


def _lora_trainer(model_dir: Path, targets: list[str]):
    from _trainer_helpers import dist_env

    from agentrl.cluster import free_port
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    dist_env(0, 1, free_port())
    lora = {"rank": LORA_RANK, "alpha": LORA_ALPHA, "target_modules": targets}
    return MegatronTrainer(
        TrainerConfig(
            model_path=str(model_dir), device="cuda", dtype="bfloat16", micro_batch_size=4, lora=lora
        )
    )


def _set_adapters(trainer, seed: int) -> None:
    """Seeded ``B`` (std 0.5; ``A`` is the trainer's own init): with A at about 1/sqrt(in) that moves each
    adapted weight by about 2/3 of the weights' own spread, so the adapted model's logprobs differ from
    the base's by far more than bf16 serving's 0.1 nats (a trained step at this size would move them by
    less, which could not tell the adapter apart from rounding)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.module.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


@torch.no_grad()
def _adapted_logprobs(
    model_dir: Path, peft: dict[str, torch.Tensor] | None, ids: list[int], start: int
) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= start of base + adapter (``W + s·B@A`` in float32; None: the base)."""
    from transformers import AutoModelForCausalLM

    from agentrl.trainer.lora import merge_into_hf

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if peft is not None:
        base = {k: v.float() for k, v in model.state_dict().items()}
        merged = merge_into_hf(base, {k: v.float() for k, v in peft.items()}, LORA_ALPHA / LORA_RANK)
        model.load_state_dict(merged)
    model = model.cuda().eval()
    logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
    lp = torch.log_softmax(logits[start - 1 : len(ids) - 1], dim=-1)
    return lp.gather(1, torch.tensor(ids[start:], device="cuda")[:, None])[:, 0].tolist()


@pytest.mark.xdist_group("sglang_lora")  # the LoRA server, apart from the plain one
@pytest.mark.parametrize(
    "targets", [ALL_TARGETS, ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]], ids=["all", "partial"]
)
async def test_lora_adapters_served_by_name(
    lora_server: SGLangLauncher, models: tuple[Path, Path], targets: list[str]
) -> None:
    """Two syncs of an agentrl LoRA trainer's adapters (in the request, ``weight_sync: tensor``), each
    version under its own name; the rollout-like client names the newest one. The served logprobs are the
    adapted model's: within bf16 serving's error (0.2 nats: SGLang adds its bf16 LoRA product to the bf16
    base, the reference is a float32 forward of the merged weights) and far from the previous version's.
    Requests that name no adapter get the base model's answer of before the syncs."""
    tr = _lora_trainer(models[0], targets)
    prompt = ids(48, seed=9)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, sampling_seed=5)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    url = lora_server.url
    try:
        async with (
            EngineClient(url, timeout=300) as trainer_side,
            EngineClient(url, timeout=300) as rollout,
            EngineClient(url, timeout=300) as base_only,
        ):
            base_only.use_adapter(None)
            base_before = await base_only.generate(prompt, greedy)
            await tr.connect_engines(WeightUpdate("tensor"), trainer_side)  # asks the server: LoRA by name
            previous = None  # the adapters of the version before (None: the base model)
            for version in (1, 2):
                _set_adapters(tr, seed=version)
                await rollout.pause(mode="abort")  # a run's update: pause, sync, continue
                assert await tr.sync_weights() == version
                await rollout.continue_generation()  # the rollout's client asks for the adapter again
                peft = tr.lora_state_dict()
                out = await rollout.generate(prompt, sp)
                assert rollout.adapters == {rollout.urls[0]: adapter_name(version)}
                assert out.weight_version == str(version)
                seq = prompt + out.output_ids
                to_adapted = gaps(out.logprobs, _adapted_logprobs(models[0], peft, seq, len(prompt)))
                to_previous = gaps(out.logprobs, _adapted_logprobs(models[0], previous, seq, len(prompt)))
                print(
                    f"{'/'.join(targets)} v{version}: |d logp| to base + adapter "
                    f"{statistics.mean(to_adapted):.4f} (max {max(to_adapted):.3f}), "
                    f"to the version before {statistics.mean(to_previous):.4f}"
                )
                assert statistics.mean(to_adapted) < 0.2
                assert statistics.mean(to_previous) > 4 * statistics.mean(to_adapted)
                previous = peft
            loaded = await rollout.loaded_adapters()
            base_after = await base_only.generate(prompt, greedy)
            assert await tr.disconnect_engines()
    finally:
        await tr.disconnect_engines()  # on this loop (a no-op once done): shutdown() would start its own
        tr.shutdown()
    assert list(loaded.values()) == [[adapter_name(2)]]  # v1 unloaded
    assert base_after.output_ids == base_before.output_ids  # the base weights stayed as they were
    assert max(gaps(base_after.logprobs, base_before.logprobs)) < 1e-3
