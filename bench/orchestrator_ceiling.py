"""Orchestrator overhead ceiling: turns/s with 1,024 concurrent episodes vs raw aiohttp requests/s.

Both figures are measured in the same run against the same zero-latency stub engine (a labelled test
stand-in for SGLang, in its own process so it never shares the client's event loop), over real HTTP
on loopback. The raw baseline posts SGLang ``/generate`` bodies of the same mean input length as the
orchestrator's requests, from 1,024 concurrent aiohttp workers. ``ratio = orchestrator turns/s / raw
requests/s`` (figures and the target: docs/results/orchestrator-ceiling.md).

    python bench/orchestrator_ceiling.py [--concurrency 1024] [--seconds 10]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import aiohttp


async def raw_requests_per_s(
    url: str, concurrency: int, seconds: float, input_len: int, max_new: int
) -> float:
    ids = list(range(3, 3 + input_len))
    done = 0
    stop_at = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                # the body is built and serialized per request, as any client must
                body = {
                    "input_ids": ids,
                    "return_logprob": True,
                    "stream": False,
                    "logprob_start_len": input_len,
                    "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new},
                }
                async with session.post(url + "/generate", json=body) as r:
                    await r.json()
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - t0)


async def orchestrator_turns_per_s(url: str, tokenizer, concurrency: int, seconds: float) -> dict:
    from agentrl.engine.client import EngineClient
    from agentrl.engine.types import SamplingParams
    from agentrl.rollout import Orchestrator, RolloutConfig
    from agentrl.testing.envs import SyntheticEnv

    group = 8
    cfg = RolloutConfig(
        group_size=group,
        batch_size=concurrency // group,
        max_staleness=2,
        max_concurrency=concurrency,
        max_turns=4,
        max_total_tokens=4096,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=16),
        filter_zero_variance=False,
    )
    client = EngineClient(url, timeout=60)
    tasks = [{"prompt": f"Question {i}: what is {i} + {i}?", "turns": 4} for i in range(1000)]
    orch = Orchestrator(cfg, client, tokenizer, lambda: SyntheticEnv(), tasks)
    stop = asyncio.Event()
    input_tokens = 0

    async def consumer() -> None:  # a trainer that takes batches instantly
        nonlocal input_tokens
        v = 0
        while not stop.is_set():
            try:
                batch = await orch.buffer.get_batch(timeout=0.5)
            except TimeoutError:
                continue
            for t in batch:  # tokens sent per turn: the prompt plus everything before that turn
                for turn in t.turns:
                    if turn.role == "assistant":
                        input_tokens += len(t.prompt_ids) + turn.start
            v += 1
            orch.controller.set_version(v)  # weights "updated" instantly; engine version not needed

    await orch.start()
    await asyncio.sleep(1.0)  # warm-up: ramp to full concurrency
    orch.stats()
    turns0 = orch.m.counters["turns"]
    t0 = time.monotonic()
    cons = asyncio.create_task(consumer())
    await asyncio.sleep(seconds)
    turns = orch.m.counters["turns"] - turns0
    dt = time.monotonic() - t0
    snap = orch.stats()
    stop.set()
    await cons
    await orch.stop()
    await client.close()
    c = orch.m.counters
    return {
        "turns_per_s": turns / dt,
        "mean_input_len": c["request_input_tokens"] / max(1, c["requests"]),
        "engine_idle_frac": snap["rollout/engine_idle_frac"],
        "episodes": orch.m.counters["episodes"],
        "failures": snap["rollout/failures_total"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per round and side")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (shared machines are noisy)")
    ap.add_argument(
        "--model-dir", default=None, help="HF model dir for the tokenizer (default: build a tiny one)"
    )
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from agentrl.testing.stub_engine import start_stub_server

    model_dir = a.model_dir
    scratch = tempfile.TemporaryDirectory(prefix="agentrl_bench_")  # removed at the end of the run
    if model_dir is None:
        from agentrl.models.tiny import build_tiny_model

        model_dir = str(build_tiny_model(scratch.name, arch="qwen2"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    srv = start_stub_server(min_tokens=4, max_tokens=16)  # zero latency
    orch_runs: list[dict] = []
    raw_runs: list[float] = []
    try:
        for _ in range(a.rounds):  # alternate, so load changes on a shared machine hit both sides alike
            orch_runs.append(asyncio.run(orchestrator_turns_per_s(srv.url, tok, a.concurrency, a.seconds)))
            raw_runs.append(
                asyncio.run(
                    raw_requests_per_s(
                        srv.url, a.concurrency, a.seconds, int(orch_runs[-1]["mean_input_len"]), 16
                    )
                )
            )
    finally:
        srv.stop()
        scratch.cleanup()
    ratios = sorted(o["turns_per_s"] / r for o, r in zip(orch_runs, raw_runs, strict=True))
    orch = max(orch_runs, key=lambda o: o["turns_per_s"])
    raw = max(raw_runs)
    print(
        json.dumps(
            {
                "bench": "orchestrator_ceiling",
                "concurrency": a.concurrency,
                "orchestrator_turns_per_s": round(orch["turns_per_s"], 1),
                "raw_aiohttp_requests_per_s": round(raw, 1),
                "ratio": round(ratios[len(ratios) // 2], 3),  # median of the per-round ratios
                "ratio_best_over_best": round(orch["turns_per_s"] / raw, 3),
                "ratios_per_round": [round(r, 3) for r in ratios],
                "mean_input_tokens": round(orch["mean_input_len"], 1),
                "engine_idle_frac": round(orch["engine_idle_frac"], 3),
                "episodes": orch["episodes"],
                "failures": orch["failures"],
                "cpus": os.cpu_count(),
                "python": sys.version.split()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
