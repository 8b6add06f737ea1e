"""No stale KV after a weight update (the embedded engine over HTTP, tiny fp32 model on CPU).

A request interrupted by a weight update and resumed afterwards is computed under the new weights from its
first token on: no prefix-cache entry made under the old weights survives the version change. Both ways a
request straddles an update: the rollout's (``pause(abort)``, update, resubmit prompt + tokens so far) and
the engine's own (``pause(retract)`` keeps the request inside, update, ``continue``). A control without
an update shows that the same resubmission does reuse the cache, so the checks can see a reuse.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.embedded.launch import EmbeddedServer, start_embedded_server
from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
TOL = 1e-4
LONG = SamplingParams(temperature=1.0, max_new_tokens=1500, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    srv = start_embedded_server(tiny_model_dir, max_batch_size=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(old model, new model, the new model's directory): the new one is the old one plus noise."""
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    path = tmp_path_factory.mktemp("perturbed")
    new.save_pretrained(path)
    return old, new.eval(), path


@torch.no_grad()
def teacher_forced(model, prompt: list[int], output: list[int]) -> list[float]:
    logp = model(torch.tensor([prompt + output])).logits.float().log_softmax(-1)[0]
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def max_err(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


async def info(client: EngineClient) -> dict:
    return (await client.server_info())[0]


async def wait_decoding(client: EngineClient, n: int, tokens: int = 40) -> None:
    """Until ``n`` requests are in the running batch and have decoded ``tokens`` steps since (a request
    the engine holds may wait for admission while the others decode)."""
    deadline = time.monotonic() + 30
    while (await info(client))["num_batch_requests"] < n:
        assert time.monotonic() < deadline, "the requests never started"
        await asyncio.sleep(0.02)
    start = (await info(client)).get("decode_steps", 0)
    while (await info(client)).get("decode_steps", 0) < start + tokens:
        assert time.monotonic() < deadline, "the requests never decoded"
        await asyncio.sleep(0.02)


async def test_aborted_request_resubmitted_after_an_update_is_recomputed(
    server: EmbeddedServer, models
) -> None:
    old, new, new_dir = models
    async with EngineClient(server.url, timeout=120) as client:
        await client.update_weight_version("v0")

        async def interrupted() -> list[int]:
            task = asyncio.ensure_future(client.generate(PROMPT, LONG))
            await wait_decoding(client, 1)
            await client.pause("abort")
            r = await asyncio.wait_for(task, 30)
            assert r.finish_reason == "abort" and 20 < len(r.output_ids) < 1500 and r.weight_version == "v0"
            return PROMPT + r.output_ids

        greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
        # control, no update: the resubmission reuses the cached KV of prompt + tokens so far
        seq = await interrupted()
        await client.continue_generation()
        before = (await info(client))["cached_tokens"]
        r = await client.generate(seq, greedy)
        assert (await info(client))["cached_tokens"] - before >= len(seq) // 2
        assert max_err(teacher_forced(old, seq, r.output_ids), r.logprobs) < TOL

        # the rollout's way through an update: abort, update (version v1), resubmit what was sampled
        seq = await interrupted()
        await client.update_weights_from_disk(str(new_dir), weight_version="v1")
        await client.continue_generation()
        before = (await info(client))["cached_tokens"]
        r = await client.generate(seq, greedy)
        assert r.weight_version == "v1"
        assert (await info(client))["cached_tokens"] == before  # nothing of the old version was reused
        assert max_err(teacher_forced(new, seq, r.output_ids), r.logprobs) < TOL  # all under the new weights
        assert max_err(teacher_forced(old, seq, r.output_ids), r.logprobs) > 1e-2

        await client.update_weights_from_disk(
            str(old.name_or_path), weight_version="v2"
        )  # as the module began


async def test_retracted_request_continues_under_the_new_weights(server: EmbeddedServer, models) -> None:
    old, new, new_dir = models
    # long enough to be mid-way at the pause and after the update on a busy machine
    sp = SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True)
    async with EngineClient(server.url, timeout=300) as client:
        await client.update_weight_version("v0")
        tasks = [asyncio.ensure_future(client.generate(PROMPT[: 12 + i], sp)) for i in range(2)]
        await wait_decoding(client, 2, tokens=20)
        await client.pause("retract")  # the requests leave the schedule (their KV to the prefix cache)
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in tasks)
        await client.update_weights_from_disk(str(new_dir), weight_version="v1")
        await client.continue_generation()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 300)  # 400 tokens on shared cores

        for i, r in enumerate(results):
            prompt = PROMPT[: 12 + i]
            assert r.finish_reason == "length" and len(r.output_ids) == 200 and r.weight_version == "v1"
            by_old = teacher_forced(old, prompt, r.output_ids)
            by_new = teacher_forced(new, prompt, r.output_ids)
            # the tokens before the update are the old weights'; every one after it, the new weights' over
            # the whole sequence (a reused prefix computed with the old weights would show here)
            k = next(j for j, (a, b) in enumerate(zip(r.logprobs, by_old, strict=True)) if abs(a - b) > TOL)
            assert 10 < k < 200
            assert max_err(r.logprobs[k:], by_new[k:]) < TOL

        await client.update_weights_from_disk(str(old.name_or_path), weight_version="v2")
