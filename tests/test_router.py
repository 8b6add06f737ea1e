"""The real SGLang router (``python -m sglang_router.launch_router``, the sglang-router CPU wheel) in front
of two embedded engines: the orchestrator runs through it on the native ``/generate`` path (an Env) and
on the OpenAI path (an openai-SDK agent through the recording proxy); pause/continue and weight updates
reach both workers. The router (0.3.2) answers 404 to /pause_generation, /continue_generation,
/abort_request and the weight-update endpoints, so EngineClient(router=True) sends those to the workers
it lists at GET /workers. Last, the main job itself (``python train_async.py``) trains two steps through
the router with ``engine.router``: an openai-SDK agent through the recording proxy, the proxy's
``/generate`` through the router, weights broadcast to both workers."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest
import sglang_router  # noqa: F401  (a test dependency: missing, the import fails; it never skips)
from transformers import AutoTokenizer

from agentrl.config import ConfigError, build_config
from agentrl.embedded.launch import start_embedded_server
from agentrl.engine.client import EngineClient
from agentrl.engine.launcher import SGLangRouterConfig, SGLangRouterLauncher
from agentrl.engine.types import SamplingParams
from agentrl.envs import make_env
from agentrl.metrics import read_metrics
from agentrl.rollout import Orchestrator, RolloutConfig
from agentrl.rollout.ray_actor import OrchestratorSpec
from agentrl.run_config import RunConfig
from agentrl.testing.envs import SyntheticEnv
from agentrl.types import Status


async def router_agent(task: dict, client: openai.AsyncOpenAI) -> float:
    messages = [{"role": "user", "content": task["prompt"]}]
    r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [r.choices[0].message, {"role": "user", "content": "again"}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return 1.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path):
    workers = [start_embedded_server(tiny_model_dir, max_batch_size=8) for _ in range(2)]
    # round robin: every test's traffic reaches both workers (the default, cache_aware, sends prompts
    # sharing a chat-template prefix to one worker until it is loaded)
    cfg = SGLangRouterConfig(
        worker_urls=[w.url for w in workers], port=0, policy="round_robin", extra_args={"log-level": "error"}
    )
    router = SGLangRouterLauncher(cfg)
    try:
        router.start()
        deadline = time.monotonic() + 60
        while True:
            assert router.process.alive(), "the router exited"
            try:
                import urllib.request

                with urllib.request.urlopen(f"{router.url}/workers", timeout=2) as resp:
                    if resp.status == 200 and resp.read().count(b'"is_healthy":true') == 2:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the router did not list two healthy workers"
            time.sleep(0.2)
        yield router.url, workers
    finally:
        router.stop()
        for w in workers:
            w.stop()


async def worker_info(workers) -> list[dict]:
    async with aiohttp.ClientSession() as s:
        out = []
        for w in workers:
            async with s.get(f"{w.url}/get_server_info") as resp:
                out.append(await resp.json())
        return out


def orchestrator(url: str, model_dir: Path, env_factory) -> Orchestrator:
    cfg = RolloutConfig(
        group_size=2,
        batch_size=2,
        max_staleness=1,
        max_concurrency=8,
        max_turns=2,
        max_total_tokens=300,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=12),
        filter_zero_variance=False,
        shuffle=False,
    )
    tasks = [{"prompt": f"task {i}", "label": "x"} for i in range(8)]
    client = EngineClient(url, router=True, timeout=120)
    return Orchestrator(cfg, client, AutoTokenizer.from_pretrained(model_dir), env_factory, tasks)


async def test_router_native_and_openai_paths_with_control_fan_out(cluster, tiny_model_dir):
    url, workers = cluster
    for name, factory in (
        ("native", lambda: SyntheticEnv(turns=2)),
        ("openai", lambda: make_env(f"{__name__}:router_agent")),
    ):
        orch = orchestrator(url, tiny_model_dir, factory)
        assert sorted(e.url for e in await orch.engine.control_endpoints()) == sorted(w.url for w in workers)
        before = [i["prompt_tokens"] for i in await worker_info(workers)]
        await orch.start()
        try:
            first = await asyncio.wait_for(orch.buffer.get_batch(), 120)
            # a weight update through the router-mode client: pause, update, continue on both workers
            await orch.pause_for_update()
            assert [i["paused"] for i in await worker_info(workers)] == ["abort", "abort"], name
            await orch.engine.update_weights_from_disk(str(tiny_model_dir), weight_version="1")
            await orch.resume_after_update(1)
            infos = await worker_info(workers)
            assert [i["paused"] for i in infos] == [None, None] and [i["weight_version"] for i in infos] == [
                "1",
                "1",
            ]
            for _ in range(3):  # a batch completed before the update may still be queued: take the next
                second = await asyncio.wait_for(orch.buffer.get_batch(), 120)
                if any(v == 1 for t in second for v in t.policy_versions):
                    break
        finally:
            await orch.stop()
            await orch.engine.update_weight_version("default")
            await orch.engine.close()
        for t in first + second:
            assert t.status == Status.COMPLETED and t.num_turns == 2, (name, t.error)
            t.validate()
        assert any(v == 1 for t in second for v, m in zip(t.policy_versions, t.loss_mask, strict=True) if m)
        after = [i["prompt_tokens"] for i in await worker_info(workers)]
        assert all(a > b for a, b in zip(after, before, strict=True)), (
            f"{name}: the router used one worker only"
        )

    # the OpenAI API straight through the router: it forwards /v1/chat/completions to a worker
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    try:
        model = (await client.models.list()).data[0].id
        r = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert r.usage.completion_tokens >= 1
    finally:
        await client.close()


async def test_a_run_config_with_a_router_reaches_its_workers(cluster, tiny_model_dir):
    """engine.router: train_async builds the rollout's client in router mode (OrchestratorSpec) and syncs
    weights to the URLs that client's worker_urls() lists, i.e. the router's workers, not the router."""
    url, workers = cluster
    base = {"model_path": str(tiny_model_dir), "data": {"path": "/d"}, "env": {"name": "synthetic"}}
    with pytest.raises(ConfigError, match=r"engine\.router: needs engine\.backend: external"):
        build_config(RunConfig, {**base, "engine": {"router": True}})
    cfg = build_config(RunConfig, {**base, "engine": {"backend": "external", "urls": [url], "router": True}})
    spec = OrchestratorSpec(
        cfg.rollout,
        cfg.engine.urls,
        str(tiny_model_dir),
        SyntheticEnv,
        [{"prompt": "p"}],
        router=cfg.engine.router,
    )
    orch = spec()
    monitor = EngineClient(cfg.engine.urls, router=cfg.engine.router, timeout=30)
    try:
        assert orch.engine.router and orch.engine.urls == [url]
        sync_urls = await monitor.worker_urls()  # what train_async hands the trainer's weight sync
        assert sorted(sync_urls) == sorted(w.url for w in workers)  # the router lists them in any order
        async with EngineClient(sync_urls, timeout=60) as direct:  # the trainer's disk sync, in short
            await direct.update_weights_from_disk(str(tiny_model_dir), weight_version="7")
        assert [i["weight_version"] for i in await worker_info(workers)] == ["7", "7"]
    finally:
        await monitor.update_weight_version("default")
        await monitor.close()
        await orch.engine.close()


RUN = """output_dir: {out}
model_path: {model}
steps: 2
data: {{path: {data}}}
env: {{name: "agentrl.examples.openai_agent:agent", kwargs: {{max_calls: 2}}}}
engine: {{backend: external, urls: ["{router}"], router: true}}
placement: disaggregated
weight_sync: distributed
rollout: {{group_size: 2, batch_size: 2, max_staleness: 1, max_concurrency: 8, max_turns: 2,
          max_total_tokens: 400, sampling: {{temperature: 1.0, max_new_tokens: 12}},
          filter_zero_variance: false}}
trainer: {{device: cpu, micro_batch_size: 4}}
"""


@pytest.mark.slow
async def test_train_async_trains_through_the_router(cluster, tiny_model_dir, tmp_path):
    """Two steps of the real main job with ``engine: {backend: external, urls: [router], router: true}``:
    the rollout generates through the router on both workers, and each step's weights reach both."""
    url, workers = cluster
    before = [i["prompt_tokens"] for i in await worker_info(workers)]
    data = tmp_path / "tasks.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} plus 2?", "label": i + 2}) + "\n" for i in range(16))
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(RUN.format(out=tmp_path / "run", model=tiny_model_dir, data=data, router=url))
    root = Path(__file__).resolve().parent.parent
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "train_async.py",
        "--config",
        str(cfg),
        cwd=root,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
        assert proc.returncode == 0, f"train_async failed:\n{out.decode()[-5000:]}"
        train = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "policy_version" in r]
        assert [r["policy_version"] for r in train] == [1, 2]
        assert all(r["batch/staleness_max"] <= 1 for r in train)
        infos = await worker_info(workers)
        assert [i["weight_version"] for i in infos] == ["2", "2"]  # every step's weights reached both
        assert all(i["paused"] is None for i in infos)
        assert all(i["prompt_tokens"] > b for i, b in zip(infos, before, strict=True)), "one worker only"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        async with EngineClient([w.url for w in workers], timeout=60) as direct:  # the original weights back
            await direct.update_weights_from_disk(str(tiny_model_dir), weight_version="default")
