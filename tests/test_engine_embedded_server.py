"""The embedded engine over real HTTP (one server subprocess per module, tiny fp32 model on CPU):
logprobs equal a teacher-forced forward pass, stops, seeds, abort, pause/continue, weight updates from disk
and by gloo broadcast from another process, concurrency, the API key and the loopback rule."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from _trainer_helpers import start_broadcaster
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.embedded.launch import EmbeddedServer, start_embedded_server
from agentrl.engine._proc import ServerStartError
from agentrl.engine.client import EngineClient, EngineRequestError
from agentrl.engine.types import SamplingParams
from agentrl.testing.processes import pid_alive

KEY = "test-admin-key"
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300], [42] * 12]
TOL = 1e-4


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    srv = start_embedded_server(tiny_model_dir, api_key=KEY, max_batch_size=64)
    yield srv
    srv.stop()
    assert not pid_alive(srv.pid), "server process survived stop()"


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
async def client(server: EmbeddedServer):
    c = EngineClient(server.url, api_key=KEY, timeout=120)
    yield c
    await c.close()


@torch.no_grad()
def teacher_forced(model, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[i] | prompt + output[:i]) from one forward pass, fp32."""
    ids = torch.tensor([prompt + output])
    logp = model(ids).logits.float().log_softmax(-1)[0]
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def max_err(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def perturbed_copy(src_dir: Path, out_dir: Path, seed: int, scale: float = 0.05):
    """Save a copy of the tiny model with noise added to every weight; returns (model, state_dict)."""
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(out_dir)
    return model.eval(), {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_logprobs_equal_teacher_forced_forward(client, hf_model, temperature: float) -> None:
    sp = SamplingParams(temperature=temperature, max_new_tokens=24, ignore_eos=True)
    results = await asyncio.gather(*(client.generate(p, sp) for p in PROMPTS))
    for prompt, r in zip(PROMPTS, results, strict=True):
        assert len(r.output_ids) == 24 and r.finish_reason == "length"
        ref = teacher_forced(hf_model, prompt, r.output_ids)
        assert max_err(ref, r.logprobs) < TOL
        if temperature == 0.0:  # greedy: every token is the argmax of the reference distribution
            ids = torch.tensor([prompt + r.output_ids])
            with torch.no_grad():
                am = hf_model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
            assert am == r.output_ids


async def test_logprobs_are_of_the_raw_model_not_the_tempered_one(client, hf_model) -> None:
    sp = SamplingParams(temperature=0.6, top_p=0.9, top_k=50, max_new_tokens=16, ignore_eos=True)
    r = await client.generate(PROMPTS[0], sp)
    assert max_err(teacher_forced(hf_model, PROMPTS[0], r.output_ids), r.logprobs) < TOL


async def test_sampling_seed_reproduces(client) -> None:
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, sampling_seed=1234)
    a, b = await asyncio.gather(client.generate(PROMPTS[1], sp), client.generate(PROMPTS[1], sp))
    c = await client.generate(PROMPTS[1], sp.model_copy(update={"sampling_seed": 99}))
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


async def test_stop_token_ids_and_stop_strings(client, tokenizer) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    base = (await client.generate(PROMPTS[0], greedy)).output_ids
    stop_id = base[6]
    r = await client.generate(PROMPTS[0], greedy.model_copy(update={"stop_token_ids": [stop_id]}))
    k = base.index(stop_id)
    assert r.output_ids == base[: k + 1]
    assert r.finish_reason == "stop" and r.matched == stop_id

    # a stop string made of the text of two generated tokens: the output ends at the token completing it
    stop = tokenizer.decode(base[8:10])
    assert stop.strip(), "test needs a visible stop string"
    end = next(j for j in range(len(base)) if stop in tokenizer.decode(base[: j + 1]))
    r = await client.generate(PROMPTS[0], greedy.model_copy(update={"stop": [stop]}))
    assert r.output_ids == base[: end + 1]
    assert r.finish_reason == "stop" and r.matched == stop
    assert len(r.logprobs) == len(r.output_ids)


async def test_eos_stops_unless_ignored(client, server: EmbeddedServer, tiny_model_dir: Path) -> None:
    eos = json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    base = (await client.generate(PROMPTS[2], greedy)).output_ids
    # make a generated token count as EOS via stop_token_ids to test the eos path deterministically
    r = await client.generate(PROMPTS[2], greedy.model_copy(update={"stop_token_ids": [base[0]]}))
    assert r.output_ids == [base[0]] and r.finish_reason == "stop"
    assert isinstance(eos, int)


async def test_64_concurrent_calls_complete_with_correct_lengths(client) -> None:
    lengths = [3 + (i % 10) for i in range(64)]
    results = await asyncio.gather(
        *(
            client.generate(
                PROMPTS[i % 3], SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True)
            )
            for i, n in enumerate(lengths)
        )
    )
    assert [len(r.output_ids) for r in results] == lengths
    assert all(len(r.logprobs) == len(r.output_ids) and r.finish_reason == "length" for r in results)


# ------------------------------------------------------------------------------------------ abort / pause
async def _wait_running(server: EmbeddedServer, n: int, timeout: float = 30.0) -> None:
    """Wait until the server has n requests in flight (so an abort lands mid-generation)."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            async with s.get(server.url + "/get_server_info") as resp:
                if (await resp.json())["num_running_requests"] >= n:
                    return
            await asyncio.sleep(0.02)
    raise AssertionError(f"{n} requests never got in flight")


async def test_abort_mid_generation_returns_partial_tokens_and_logprobs(client, server, hf_model) -> None:
    sp = SamplingParams(temperature=1.0, max_new_tokens=1500, ignore_eos=True)
    task = asyncio.create_task(client.generate(PROMPTS[0], sp, rid="long-one"))
    await _wait_running(server, 1)
    await asyncio.sleep(0.5)
    await client.abort("long-one")
    r = await asyncio.wait_for(task, 30)
    assert r.finish_reason == "abort"
    assert 0 < len(r.output_ids) < 1500
    assert len(r.logprobs) == len(r.output_ids)
    assert max_err(teacher_forced(hf_model, PROMPTS[0], r.output_ids), r.logprobs) < TOL


async def test_pause_abort_with_32_in_flight_then_continue(client, server) -> None:
    sp = SamplingParams(temperature=1.0, max_new_tokens=1200, ignore_eos=True)
    tasks = [asyncio.create_task(client.generate(PROMPTS[i % 3], sp)) for i in range(32)]
    await _wait_running(server, 32)
    await asyncio.sleep(0.5)
    await client.pause("abort")
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(r.finish_reason == "abort" for r in results)
    assert all(len(r.logprobs) == len(r.output_ids) < 1200 for r in results)
    assert sum(len(r.output_ids) > 0 for r in results) >= 16  # they were mid-generation

    # while paused, a new request waits; continue lets it run to completion
    waiting = asyncio.create_task(
        client.generate(PROMPTS[0], SamplingParams(max_new_tokens=5, ignore_eos=True))
    )
    await asyncio.sleep(0.5)
    assert not waiting.done()
    await client.continue_generation()
    r = await asyncio.wait_for(waiting, 30)
    assert r.finish_reason == "length" and len(r.output_ids) == 5


async def test_pause_retract_keeps_requests_and_resumes(client, server, hf_model) -> None:
    # 200 tokens: still running at the pause (about 4 ms a decode step), and done within the bound on a
    # machine whose other core is busy (0.2 s a step there: torch's two threads share one core)
    sp = SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True)
    tasks = [asyncio.create_task(client.generate(PROMPTS[i % 3], sp)) for i in range(4)]
    await _wait_running(server, 4)
    await asyncio.sleep(0.1)
    await client.pause("retract")
    await asyncio.sleep(0.3)
    assert not any(t.done() for t in tasks)
    await client.continue_generation()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for i, r in enumerate(results):
        assert r.finish_reason == "length" and len(r.output_ids) == 200
        assert max_err(teacher_forced(hf_model, PROMPTS[i % 3], r.output_ids), r.logprobs) < TOL


async def test_client_disconnect_cancels_the_request(server) -> None:
    # While paused the request would wait forever: only the disconnect can remove it.
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 8}}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        async with s.post(server.url + "/pause_generation", json={"mode": "abort"}) as resp:
            assert resp.status == 200
        try:
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(
                    server.url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=0.5)
                ):
                    pass
            deadline = time.monotonic() + 10
            while (await (await s.get(server.url + "/get_server_info")).json())["num_running_requests"] != 0:
                assert time.monotonic() < deadline, "the server kept a request whose client went away"
                await asyncio.sleep(0.05)
        finally:
            async with s.post(server.url + "/continue_generation", json={}) as resp:
                assert resp.status == 200


async def test_generate_stream_is_sglangs_cumulative_events(server) -> None:
    """stream: true answers SGLang's server-sent events, each the answer so far; the first arrives while
    the request runs, the last equals the non-streamed answer, and a client that leaves aborts it."""
    body = {
        "input_ids": PROMPTS[1],
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 40, "sampling_seed": 9, "ignore_eos": True},
        "return_logprob": True,
    }
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        async with s.post(server.url + "/generate", json=body) as resp:
            whole = await resp.json()
        async with s.post(server.url + "/generate", json={**body, "stream": True}) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = [e.removeprefix("data: ") for e in (await resp.text()).split("\n\n") if e]
        assert events[-1] == "[DONE]"
        answers = [json.loads(e) for e in events[:-1]]
        assert len(answers) > 2 and answers[-1] == {**whole, "meta_info": answers[-1]["meta_info"]}
        for meta in ("output_token_logprobs", "finish_reason", "completion_tokens", "weight_version"):
            assert answers[-1]["meta_info"][meta] == whole["meta_info"][meta]
        for a, b in itertools.pairwise(answers):  # cumulative, unfinished until the last
            assert a["meta_info"]["finish_reason"] is None
            assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]

        long = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
        before = (await (await s.get(server.url + "/get_server_info")).json())["decode_steps"]
        async with s.post(server.url + "/generate", json={**long, "stream": True}) as resp:
            first = json.loads((await resp.content.readuntil(b"\n\n")).decode().removeprefix("data: "))
            assert first["meta_info"]["finish_reason"] is None
            info = await (await s.get(server.url + "/get_server_info")).json()
            assert info["num_running_requests"] == 1  # still generating when its first event came
        deadline = time.monotonic() + 10  # the response closed unread: the request is aborted
        while (info := await (await s.get(server.url + "/get_server_info")).json())["num_running_requests"]:
            assert time.monotonic() < deadline, "the server kept a stream whose client went away"
            await asyncio.sleep(0.05)
        assert info["decode_steps"] - before < 1499, "it generated on for nobody"


# ------------------------------------------------------------------------------------------ weights
async def test_update_weights_from_disk(client, server, tiny_model_dir, hf_model, tmp_path) -> None:
    new_model, _ = perturbed_copy(tiny_model_dir, tmp_path / "perturbed", seed=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    before = await client.generate(PROMPTS[0], greedy)

    # an update waits for in-flight requests, which finish entirely on the old weights
    inflight = [
        asyncio.create_task(
            client.generate(p, SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True))
        )
        for p in PROMPTS
    ]
    await asyncio.sleep(0.05)
    await client.update_weights_from_disk(str(tmp_path / "perturbed"), weight_version="v1")
    for p, t in zip(PROMPTS, inflight, strict=True):
        r = t.result()  # done before the update returned
        assert r.finish_reason == "length" and r.weight_version != "v1"
        assert max_err(teacher_forced(hf_model, p, r.output_ids), r.logprobs) < TOL

    for temperature in (0.0, 1.0):
        after = await client.generate(PROMPTS[0], greedy.model_copy(update={"temperature": temperature}))
        assert after.weight_version == "v1"
        assert max_err(teacher_forced(new_model, PROMPTS[0], after.output_ids), after.logprobs) < TOL
        assert max_err(teacher_forced(hf_model, PROMPTS[0], after.output_ids), after.logprobs) > 1e-3

    # a checkpoint that does not fit is refused and changes nothing
    with pytest.raises(EngineRequestError):
        await client.update_weights_from_disk(str(tmp_path / "missing"), weight_version="bad")
    assert (await client.model_info())["weight_version"] == "v1"

    await client.update_weights_from_disk(
        str(tiny_model_dir), weight_version="v0-restored", abort_all_requests=True
    )
    again = await client.generate(PROMPTS[0], greedy)
    assert again.output_ids == before.output_ids and again.weight_version == "v0-restored"
    assert max_err(before.logprobs, again.logprobs) < TOL


async def test_update_with_abort_all_aborts_in_flight(client, server, tiny_model_dir, hf_model) -> None:
    sp = SamplingParams(temperature=1.0, max_new_tokens=1500, ignore_eos=True)
    tasks = [asyncio.create_task(client.generate(p, sp)) for p in PROMPTS]
    await _wait_running(server, 3)
    await asyncio.sleep(0.3)
    await client.update_weights_from_disk(
        str(tiny_model_dir), weight_version="v-abort", abort_all_requests=True
    )
    results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    for p, r in zip(PROMPTS, results, strict=True):
        assert r.finish_reason == "abort" and len(r.output_ids) < 1500
        assert max_err(teacher_forced(hf_model, p, r.output_ids), r.logprobs) < TOL


async def test_update_weights_from_distributed_gloo(client, tiny_model_dir, hf_model, tmp_path) -> None:
    new_model, sd = perturbed_copy(tiny_model_dir, tmp_path / "dist", seed=2)
    save_file(sd, str(tmp_path / "w.safetensors"))
    names = list(sd)
    trainer, port = await start_broadcaster(str(tmp_path / "w.safetensors"), names, "agentrl_test_sync")
    try:
        await client.init_weights_update_group("127.0.0.1", port, 1, 2, "agentrl_test_sync", "gloo")
        await client.update_weights_from_distributed(
            names,
            [str(sd[n].dtype) for n in names],
            [list(sd[n].shape) for n in names],
            "agentrl_test_sync",
            weight_version="v2",
        )
        out = (await asyncio.wait_for(trainer.communicate(), 120))[0].decode()
        assert trainer.returncode == 0, out
        assert "broadcast done" in out
        await client.destroy_weights_update_group("agentrl_test_sync")
    finally:
        if trainer.returncode is None:
            trainer.kill()
            await trainer.wait()
    for temperature in (0.0, 1.0):
        r = await client.generate(
            PROMPTS[1], SamplingParams(temperature=temperature, max_new_tokens=16, ignore_eos=True)
        )
        assert r.weight_version == "v2"
        assert max_err(teacher_forced(new_model, PROMPTS[1], r.output_ids), r.logprobs) < TOL
        assert max_err(teacher_forced(hf_model, PROMPTS[1], r.output_ids), r.logprobs) > 1e-3
    await client.update_weights_from_disk(str(tiny_model_dir), weight_version="v3")
    await client.update_weight_version("v4")
    assert (await client.generate(PROMPTS[1], SamplingParams(max_new_tokens=2))).weight_version == "v4"


# ---------------------------------------------------------------------------------------- protocol / security
async def test_api_key_guards_every_endpoint_but_health(server: EmbeddedServer) -> None:
    async with aiohttp.ClientSession() as s:
        for path, body in [
            ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
            ("/update_weights_from_disk", {"model_path": "/tmp"}),
            ("/pause_generation", {"mode": "abort"}),
            ("/abort_request", {"abort_all": True}),
            ("/init_weights_update_group", {}),
            ("/flush_cache", {}),
        ]:
            async with s.post(server.url + path, json=body) as resp:
                assert resp.status == 401, path
            async with s.post(
                server.url + path, json=body, headers={"Authorization": "Bearer wrong"}
            ) as resp:
                assert resp.status == 401, path
        async with s.get(server.url + "/get_model_info") as resp:
            assert resp.status == 401
        async with s.get(server.url + "/health") as resp:
            assert resp.status == 200
        async with s.get(server.url + "/health_generate") as resp:
            assert resp.status == 200


async def test_native_json_shapes_and_bad_requests(server: EmbeddedServer, tokenizer) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=h) as s:
        body = {
            "text": "hello world",
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
            "rid": "x1",
        }
        async with s.post(server.url + "/generate", json=body) as resp:
            assert resp.status == 200
            out = await resp.json()
        assert set(out) == {"text", "output_ids", "meta_info"}
        meta = out["meta_info"]
        assert meta["id"] == "x1" and meta["prompt_tokens"] == len(tokenizer.encode("hello world"))
        assert meta["finish_reason"] == {"type": "length", "length": 3} and meta["completion_tokens"] == 3
        assert "output_token_logprobs" not in meta  # not asked for

        batch = {
            "input_ids": [[1, 2], [3, 4, 5]],
            "sampling_params": {"max_new_tokens": 2},
            "return_logprob": True,
        }
        async with s.post(server.url + "/generate", json=batch) as resp:
            outs = await resp.json()
        assert isinstance(outs, list) and len(outs) == 2
        lp = outs[0]["meta_info"]["output_token_logprobs"]
        assert (
            len(lp) == len(outs[0]["output_ids"])
            and lp[0][1] == outs[0]["output_ids"][0]
            and lp[0][2] is None
        )

        for bad in [
            {"input_ids": [1], "sampling_params": {"top_p": 0}},
            {"input_ids": [1], "sampling_params": {"n": 2}},
            {"input_ids": [1], "sampling_params": {"regex": "a+"}},
            {"input_ids": [10**9]},
            {"input_ids": [[1], [2]], "stream": True},  # a stream takes one request
            {"input_ids": [10**9], "stream": True},  # refused before the stream starts: a plain 400
            {"sampling_params": {}},
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**6}},
        ]:
            async with s.post(server.url + "/generate", json=bad) as resp:
                assert resp.status == 400, bad
                assert (await resp.json())["error"]["message"]
        async with s.get(server.url + "/get_server_info") as resp:
            info = await resp.json()
        assert info["tp_size"] == 1 and "stand-in for SGLang" in info["engine"]
        async with s.post(server.url + "/flush_cache") as resp:
            assert resp.status == 200, await resp.text()


def test_refuses_non_loopback_host_without_api_key(tiny_model_dir: Path) -> None:
    cmd = [sys.executable, "-m", "agentrl.embedded.server", "--model", str(tiny_model_dir)]
    proc = subprocess.run(
        [*cmd, "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "refusing to serve on non-loopback address" in proc.stderr


# ------------------------------------------------------------------------------------------ GPU (by hand)
@pytest.mark.gpu
async def test_gpu_logprobs_fp32_and_bf16(tiny_model_dir: Path) -> None:
    """On one GPU: fp32 logprobs match a teacher-forced forward on the GPU; bf16 serves sane answers."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    for dtype in ("float32", "bfloat16"):
        srv = start_embedded_server(tiny_model_dir, device="cuda", dtype=dtype)
        try:
            async with EngineClient(srv.url) as c:
                sp = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)
                rs = await asyncio.gather(*(c.generate(PROMPTS[i % 3], sp) for i in range(16)))
            for i, r in enumerate(rs):
                assert len(r.output_ids) == 32
                with torch.no_grad():
                    ids = torch.tensor([PROMPTS[i % 3] + r.output_ids], device="cuda")
                    logp = model(ids).logits.float().log_softmax(-1)[0]
                ref = [logp[len(PROMPTS[i % 3]) - 1 + k, t].item() for k, t in enumerate(r.output_ids)]
                assert max_err(ref, r.logprobs) < (1e-4 if dtype == "float32" else 0.1)
        finally:
            srv.stop()


def test_a_stopped_or_failed_server_leaves_no_temp_dir(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = start_embedded_server(tiny_model_dir, max_batch_size=2)
    scratch = srv.process.scratch_dir
    assert scratch is not None and (scratch / "port").is_file()
    srv.stop()
    assert not scratch.exists()
    before = set(Path(tempfile.gettempdir()).glob("agentrl-engine-*"))
    with pytest.raises(ServerStartError, match="exited with code"):
        start_embedded_server(tmp_path / "no-model-here", timeout=60)
    assert set(Path(tempfile.gettempdir()).glob("agentrl-engine-*")) <= before
