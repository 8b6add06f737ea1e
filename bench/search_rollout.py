"""Benchmark: what limits a Search-R1 rollout, its one event loop or its retrieval server.

The rollout orchestrator runs real ``SearchEnv`` episodes at ``--concurrency`` against a zero-latency
SGLang stand-in (a labelled test engine in its own process, scripted to answer ``<search> name
</search>`` twice for each ``<answer>``) and the bm25s /retrieve server over the world's corpus, the
way a run drives them; a trainer stand-in takes each batch at once. For a server of 1 worker and of
``--workers`` workers (same run, fresh server each), over ``--seconds`` after a warm-up it reports:

* the orchestrator's event loop (``agentrl.rollout.loop_monitor``): busy fraction, CPU fraction, lag p90,
  and its time per turn (busy seconds / turns);
* turns/s and searches/s, the search latency the env saw (mean, p90) against the server's own time per
  request and its busy fraction (``RetrievalLoad``).

With a zero-latency engine (the default) the loop runs as fast as it can: ``loop_ms_per_turn`` is its
cost, so ``turns/s x loop_ms_per_turn / 1000`` is its busy fraction at another run's rate;
``--engine-latency`` paces the engine instead (seconds a request). One JSON line.

    python bench/search_rollout.py [--concurrency 512] [--seconds 10] [--workers 2] [--engine-latency 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any


async def rollout_window(
    url: str, retrieval_url: str, tok: Any, tasks: list[dict], a: argparse.Namespace
) -> dict:
    """The orchestrator with SearchEnv episodes against the stub engine; figures of one window."""
    import functools

    from agentrl.engine.client import EngineClient
    from agentrl.engine.types import SamplingParams
    from agentrl.envs.search import SearchEnv
    from agentrl.examples.search_r1.retrieval_workers import RetrievalLoad
    from agentrl.rollout import Orchestrator, RolloutConfig

    group = 8
    cfg = RolloutConfig(
        group_size=group,
        batch_size=max(1, a.concurrency // group // 2),
        max_staleness=2,
        max_concurrency=a.concurrency,
        max_turns=4,
        max_total_tokens=2048,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=64),
        verifier="exact_match",
        filter_zero_variance=False,
    )
    client = EngineClient(url, timeout=120)
    env = functools.partial(SearchEnv, retrieval_url=retrieval_url, topk=3, max_turns=3)
    orch = Orchestrator(cfg, client, tok, env, tasks)
    stop = asyncio.Event()

    async def trainer() -> None:  # takes batches at once; new weights at once (no pause)
        v = 0
        while not stop.is_set():
            try:
                await orch.buffer.get_batch(timeout=0.5)
            except TimeoutError:
                continue
            v += 1
            orch.controller.set_version(v)
            await client.update_weight_version(str(v))  # the tokens that follow carry it

    load = RetrievalLoad(retrieval_url)
    await client.update_weight_version("0")  # the engine is shared by the windows: start at 0 again
    await orch.start()
    consumer = asyncio.create_task(trainer())
    await asyncio.sleep(a.warmup)
    orch.stats()
    load.read()
    await asyncio.sleep(a.seconds)
    stats = orch.stats()
    server = await asyncio.to_thread(load.read)
    stop.set()
    await consumer
    await orch.stop()
    await client.close()
    turns = stats["rollout/turns_per_s"] * a.seconds
    busy = stats["rollout/loop_busy_frac"]
    return {
        "turns_per_s": round(stats["rollout/turns_per_s"], 1),
        "searches_per_s": round(server.get("retrieval/requests_per_s", 0.0), 1),
        "loop_busy_frac": round(busy, 3),
        "loop_cpu_frac": round(stats["rollout/loop_cpu_frac"], 3),
        "loop_lag_ms_p90": round(stats["rollout/loop_lag_ms_p90"], 2),
        "loop_ms_per_turn": round(1000 * busy * a.seconds / max(turns, 1), 3),
        "env_step_ms_mean": round(1000 * stats["rollout/tool_latency_mean_s"], 2),
        "env_step_ms_p90": round(1000 * stats["rollout/tool_latency_p90_s"], 2),
        "server_request_ms_mean": round(server.get("retrieval/request_ms_mean", 0.0), 2),
        "server_queue_ms_mean": round(server.get("retrieval/queue_ms_mean", 0.0), 2),
        "server_busy_frac": round(server.get("retrieval/busy_frac", 0.0), 3),
        "failures": stats["rollout/failures_total"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=512, help="episodes in flight")
    p.add_argument("--seconds", type=float, default=10.0, help="measured window per server")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before the window")
    p.add_argument("--workers", type=int, default=2, help="retrieval workers of the second server")
    p.add_argument("--entities", type=int, default=2000, help="world size (the GPU demo's: 2000)")
    p.add_argument("--engine-latency", type=float, default=0.0, help="seconds the engine takes a request")
    a = p.parse_args()
    from transformers import AutoTokenizer

    from agentrl.examples.search_r1.retrieval_workers import start_retrieval_server
    from agentrl.examples.search_r1.world import generate_world
    from agentrl.models.tiny import build_tiny_model
    from agentrl.testing.stub_engine import start_stub_server

    with tempfile.TemporaryDirectory(prefix="agentrl-bench-search-rollout-") as tmp:
        world = generate_world(seed=0, num_entities=a.entities)
        corpus = world.write(Path(tmp) / "world")["corpus"]
        tasks = [{"question": t["prompt"], "label": t["label"]} for t in world.train]
        tok = AutoTokenizer.from_pretrained(build_tiny_model(Path(tmp) / "model", arch="qwen2"))
        names = [t["info"]["subject_name"] for t in world.train[:60]]
        script = []
        for i, name in enumerate(names):  # two searches, then an answer, over and over
            for text in (
                f"<search> {name} </search>",
                f"<search> {names[i - 1]} </search>",
                "<answer> 1 </answer>",
            ):
                script.append(tok.encode(text, add_special_tokens=False))
        engine = start_stub_server(script=script, base_latency=a.engine_latency)
        rows = {}
        try:
            for workers in dict.fromkeys((1, a.workers)):
                with start_retrieval_server(corpus, workers=workers) as server:
                    rows[f"workers{workers}"] = asyncio.run(
                        rollout_window(engine.url, server.url, tok, tasks, a)
                    )
        finally:
            engine.stop()
    print(
        json.dumps(
            {
                "bench": "search_rollout",
                "concurrency": a.concurrency,
                "seconds": a.seconds,
                "engine_latency_s": a.engine_latency,
                "passages": len(world.corpus),
                **rows,
                "cpus": os.cpu_count(),
                "load_1min": round(os.getloadavg()[0], 2),
                "python": platform.python_version(),
            }
        )
    )


if __name__ == "__main__":
    main()
