"""EngineClient against real aiohttp servers on loopback that misbehave on purpose: 5xx, dropped
connections, 4xx, slowness, dead endpoints; plus routing, fan-out of control calls and the Bearer key."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest
from aiohttp import web

from agentrl.cluster import free_port
from agentrl.engine.client import (
    EngineClient,
    EngineError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)
from agentrl.engine.types import SamplingParams


def _ok_body(n: int = 3, rid: str = "r") -> dict[str, Any]:
    return {
        "text": "abc",
        "output_ids": list(range(10, 10 + n)),
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": 2,
            "completion_tokens": n,
            "weight_version": "7",
            "output_token_logprobs": [[-0.5 - i, 10 + i, None] for i in range(n)],
        },
    }


class FakeEngine:
    """A scriptable SGLang-shaped server: ``fail_next`` 5xx answers, ``drop_next`` dropped connections."""

    def __init__(self, tp_size: int = 1) -> None:
        self.fail_next = 0
        self.drop_next = 0
        self.delay = 0.0
        self.tp_size = tp_size
        self.calls: Counter[str] = Counter()
        self.bodies: dict[str, list[Any]] = {}
        self.auth: list[str | None] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/v1/models":  # the client's adapter lookup before its first /generate: no adapters
            return web.json_response({"object": "list", "data": [{"id": "/m", "root": "/m", "parent": None}]})
        self.calls[path] += 1
        self.auth.append(request.headers.get("Authorization"))
        body = await request.json() if request.can_read_body else None
        self.bodies.setdefault(path, []).append(body)
        if self.drop_next > 0:
            self.drop_next -= 1
            request.transport.close()  # the client sees the connection die without an answer
            return web.Response()
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.Response(status=503, text="overloaded")
        if self.delay:
            await asyncio.sleep(self.delay)
        if path == "/generate":
            if body["input_ids"] == [666]:
                return web.json_response({"error": {"message": "prompt too long: 666"}}, status=400)
            return web.json_response(_ok_body(rid=body.get("rid", "r")))
        if path == "/update_weights_from_disk":
            if body["model_path"] == "/nope":
                return web.json_response({"success": False, "message": "no such checkpoint"}, status=400)
            return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
        if path == "/update_weights_from_distributed" and body["names"] == ["bad"]:
            return web.json_response(
                {"success": False, "message": "unknown parameter"}
            )  # 200 + success false
        if path == "/get_server_info":
            return web.json_response({"tp_size": self.tp_size})
        if path == "/get_model_info":
            return web.json_response({"model_path": "/m"})
        if path == "/health":
            return web.Response(text="")
        return web.json_response({"success": True, "status": "ok"})

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()


@pytest.fixture
async def engine():
    e = await FakeEngine().start()
    yield e
    await e.stop()


@pytest.fixture
async def engines():
    es = [await FakeEngine(tp_size=2).start(), await FakeEngine(tp_size=2).start()]
    yield es
    for e in es:
        await e.stop()


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there any more


SP = SamplingParams(max_new_tokens=3, temperature=1.0)


async def test_generate_parses_sglang_answer_and_sends_native_fields(engine: FakeEngine) -> None:
    async with EngineClient(engine.url, api_key="k3y") as c:
        r = await c.generate([1, 2], SP, rid="abc")
    assert r.output_ids == [10, 11, 12]
    assert r.logprobs == [-0.5, -1.5, -2.5]
    assert r.finish_reason == "length" and r.weight_version == "7" and r.rid == "abc"
    body = engine.bodies["/generate"][0]
    assert body["input_ids"] == [1, 2] and body["return_logprob"] is True and body["rid"] == "abc"
    assert body["sampling_params"]["max_new_tokens"] == 3
    assert engine.auth == ["Bearer k3y"]


async def test_retries_5xx_then_succeeds(engine: FakeEngine) -> None:
    engine.fail_next = 2
    async with EngineClient(engine.url, max_retries=3, backoff=0.01) as c:
        r = await c.generate([1], SP)
    assert r.output_ids == [10, 11, 12]
    assert engine.calls["/generate"] == 3


async def test_retries_dropped_connection(engine: FakeEngine) -> None:
    engine.drop_next = 2
    async with EngineClient(engine.url, max_retries=2, backoff=0.01) as c:
        r = await c.generate([1], SP)
    assert len(r.output_ids) == 3 and engine.calls["/generate"] == 3


async def test_5xx_exhausts_retries_with_backoff(engine: FakeEngine) -> None:
    engine.fail_next = 100
    t0 = time.monotonic()
    async with EngineClient(engine.url, max_retries=2, backoff=0.1) as c:
        with pytest.raises(EngineUnavailable, match="503"):
            await c.generate([1], SP)
    # 3 attempts, backoff 0.1 and 0.2 (jitter 0.75..1.25) between them
    assert engine.calls["/generate"] == 3
    assert time.monotonic() - t0 >= 0.2


async def test_connection_refused_is_unavailable() -> None:
    async with EngineClient(_dead_url(), max_retries=1, backoff=0.01) as c:
        with pytest.raises(EngineUnavailable, match="attempts"):
            await c.generate([1], SP)
        assert await c.health() is False


async def test_4xx_is_not_retried_and_carries_server_message(engine: FakeEngine) -> None:
    async with EngineClient(engine.url, max_retries=3, backoff=0.01) as c:
        with pytest.raises(EngineRequestError, match="prompt too long: 666") as info:
            await c.generate([666], SP)
        assert info.value.status == 400
        with pytest.raises(EngineRequestError, match="no such checkpoint"):
            await c.update_weights_from_disk("/nope")
        with pytest.raises(EngineRequestError, match="unknown parameter"):
            await c.update_weights_from_distributed(["bad"], ["float32"], [[1]], "g")
    assert engine.calls["/generate"] == 1


async def test_timeout(engine: FakeEngine) -> None:
    engine.delay = 1.0
    async with EngineClient(engine.url, timeout=0.2, max_retries=3) as c:
        with pytest.raises(EngineTimeout):
            await c.generate([1], SP)
        assert engine.calls["/generate"] == 1  # not retried
    assert issubclass(EngineTimeout, EngineError)


async def test_least_loaded_routing_spreads_concurrent_requests(engines: list[FakeEngine]) -> None:
    for e in engines:
        e.delay = 0.2
    async with EngineClient([e.url for e in engines]) as c:
        results = await asyncio.gather(*(c.generate([1], SP) for _ in range(10)))
    assert len(results) == 10
    assert [e.calls["/generate"] for e in engines] == [5, 5]


async def test_failover_to_live_endpoint(engine: FakeEngine) -> None:
    async with EngineClient([_dead_url(), engine.url], max_retries=2, backoff=0.01) as c:
        results = await asyncio.gather(*(c.generate([1], SP) for _ in range(6)))
    assert all(r.output_ids == [10, 11, 12] for r in results)
    assert engine.calls["/generate"] == 6


async def test_control_calls_fan_out_to_every_endpoint(engines: list[FakeEngine]) -> None:
    async with EngineClient([e.url for e in engines]) as c:
        await c.pause("abort")
        await c.continue_generation()
        await c.flush_cache()
        await c.abort()
        await c.update_weights_from_disk("/ckpt", weight_version="3", abort_all_requests=True)
        await c.update_weight_version("4")
        await c.update_weights_from_distributed(["w"], ["torch.bfloat16"], [[2, 3]], "g", weight_version="5")
        flat = "flattened_bucket"
        await c.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 3]], "g", load_format=flat)
        await c.init_weights_update_group("127.0.0.1", 29500, 1, 5, "g", "nccl")
        assert await c.health() is True
        assert await c.model_info() == {"model_path": "/m"}
        with pytest.raises(ValueError, match="pause mode"):
            await c.pause("sideways")
    for e in engines:
        assert e.bodies["/pause_generation"] == [{"mode": "abort"}]
        assert e.bodies["/abort_request"] == [{"abort_all": True}]
        assert e.bodies["/update_weights_from_disk"][0] == {
            "model_path": "/ckpt",
            "abort_all_requests": True,
            "weight_version": "3",
        }
        assert e.bodies["/update_weight_version"][0] == {"new_version": "4", "abort_all_requests": False}
        dist, flat = e.bodies["/update_weights_from_distributed"]
        assert dist["dtypes"] == ["bfloat16"] and dist["shapes"] == [[2, 3]] and dist["weight_version"] == "5"
        assert "load_format" not in dist and flat["load_format"] == "flattened_bucket"
    # rank offsets: trainer is rank 0, each engine has tp_size 2 -> 1 and 3
    offsets = [e.bodies["/init_weights_update_group"][0]["rank_offset"] for e in engines]
    assert offsets == [1, 3]


async def test_abort_by_rid_goes_to_the_endpoint_serving_it(engines: list[FakeEngine]) -> None:
    for e in engines:
        e.delay = 0.3
    async with EngineClient([e.url for e in engines]) as c:
        task = asyncio.create_task(c.generate([1], SP, rid="target"))
        await asyncio.sleep(0.1)
        await c.abort("target")
        await task
    serving = [e for e in engines if e.calls["/generate"]]
    assert len(serving) == 1
    assert serving[0].bodies["/abort_request"] == [{"rid": "target"}]
    other = next(e for e in engines if e is not serving[0])
    assert "/abort_request" not in other.calls


async def test_missing_logprobs_is_an_error(engine: FakeEngine) -> None:
    async def no_lp(request: web.Request) -> web.Response:
        return web.json_response({"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop"}}})

    app = web.Application()
    app.router.add_post("/generate", no_lp)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with EngineClient(f"http://127.0.0.1:{port}") as c:
            with pytest.raises(EngineError):
                await c.generate([1], SP)
    finally:
        await runner.cleanup()


def test_client_can_be_reused_across_event_loops() -> None:
    async def serve_and_call(c: EngineClient) -> list[int]:
        e = await FakeEngine().start()
        try:
            c.endpoints[0].url = e.url
            return (await c.generate([1], SP)).output_ids
        finally:
            await e.stop()

    c = EngineClient("http://127.0.0.1:1")
    assert asyncio.run(serve_and_call(c)) == [10, 11, 12]
    assert asyncio.run(serve_and_call(c)) == [10, 11, 12]
    asyncio.run(c.close())


def test_json_helpers_agree_with_the_standard_library() -> None:
    import json
    import math

    from agentrl.engine.json_body import dumps_json, loads_json

    payload = {
        "input_ids": [0, 1, 151643, 2**31],
        "sampling_params": {"temperature": 0.7, "top_p": 1.0, "stop": ["</search>", "é 中"]},
        "return_logprob": True,
        "rid": None,
    }
    assert json.loads(dumps_json(payload)) == payload
    answer = json.dumps({"meta_info": {"output_token_logprobs": [[-1.2345678901234567e-5, 7, None]]}})
    assert loads_json(answer.encode()) == json.loads(answer)
    # what only the standard library parses (a non-finite float) still parses
    assert math.isinf(loads_json(b'{"lp": -Infinity}')["lp"])
    with pytest.raises(ValueError):
        loads_json(b"not json")


async def test_generate_sends_a_json_body_of_plain_ints() -> None:
    import numpy as np

    engine = FakeEngine()
    seen: list[str | None] = []
    handle = engine.handle

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Content-Type"))
        return await handle(request)

    engine.handle = record  # type: ignore[method-assign]
    await engine.start()
    try:
        async with EngineClient(engine.url) as c:
            await c.generate(list(np.array([5, 6, 7], dtype=np.int64)), SP, rid="np")
    finally:
        await engine.stop()
    assert engine.bodies["/generate"][0]["input_ids"] == [5, 6, 7]
    assert seen[-1] == "application/json"
