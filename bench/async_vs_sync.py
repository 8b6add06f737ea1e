"""Async vs sync RL rollouts on a long-tailed agentic workload: wall-clock for the same trained data.

The engine is the stub engine (a labelled SGLang stand-in, in its own process) with a per-token time
model and log-normal response lengths; the env has 1-4 turns and log-normal tool latencies; a "train
step" takes a fixed time. Every mode trains ``steps`` batches of ``batch_size`` groups x ``group_size``
samples through the real orchestrator, buffer and weight-update protocol (pause, update version,
continue):

- sync   (max_staleness 0): generate the whole batch, then train, then generate the next one;
- async  eta=1 / eta=2: generation continues while the trainer trains, up to eta versions stale.

Prints one JSON line: wall-clock per mode, speedups vs sync, and the measured staleness (mean/max over
trained trajectories) per mode. Figures: docs/results/async-vs-sync.md.

    python bench/async_vs_sync.py [--steps 8] [--train-time 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import tempfile
import time
from typing import Any


async def run_mode(url: str, tok: Any, eta: int, a: argparse.Namespace) -> dict[str, float]:
    from agentrl.engine.client import EngineClient
    from agentrl.engine.types import SamplingParams
    from agentrl.rollout import Orchestrator, RolloutConfig
    from agentrl.testing.envs import SyntheticEnv, lognormal

    cfg = RolloutConfig(
        group_size=a.group_size,
        batch_size=a.batch_size,
        max_staleness=eta,
        max_concurrency=1024,
        max_turns=4,
        max_total_tokens=8192,
        sampling=SamplingParams(max_new_tokens=a.max_tokens),
        filter_zero_variance=False,
        shuffle=True,
        seed=0,
    )
    client = EngineClient(url, timeout=120)
    await client.update_weight_version("0")  # every mode starts from version 0 on the same engine
    tasks = [{"prompt": f"Task {i}: find the answer.", "turns": 1 + (i * 7919) % 4} for i in range(10_000)]
    env = functools.partial(SyntheticEnv, tool_latency=lognormal(a.tool_median, a.tool_sigma))
    orch = Orchestrator(cfg, client, tok, env, tasks)
    staleness: list[int] = []
    t0 = time.monotonic()
    await orch.start()
    for _ in range(a.steps):
        batch = await orch.buffer.get_batch()
        staleness += [orch.version - t.min_policy_version for t in batch]
        await asyncio.sleep(a.train_time)  # the train step (generation goes on meanwhile when eta > 0)
        await orch.pause_for_update()
        await client.update_weight_version(str(orch.version + 1))
        await orch.resume_after_update(orch.version + 1)
    wall = time.monotonic() - t0
    stats = orch.stats()
    await orch.stop()
    await client.close()
    return {
        "wall_s": wall,
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": max(staleness),
        "trajectories": len(staleness),
        "interrupted_requests": stats["rollout/interrupted_requests"]
        if "rollout/interrupted_requests" in stats
        else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8, help="groups per train step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--train-time", type=float, default=1.0, help="seconds per train step")
    ap.add_argument("--per-token-time", type=float, default=0.002, help="engine seconds per sampled token")
    ap.add_argument("--median-tokens", type=int, default=48, help="median response tokens per turn")
    ap.add_argument("--length-sigma", type=float, default=1.0, help="log-normal sigma of response lengths")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--tool-median", type=float, default=0.1, help="median tool latency (s)")
    ap.add_argument("--tool-sigma", type=float, default=1.0)
    ap.add_argument("--model-dir", default=None)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from agentrl.testing.stub_engine import start_stub_server

    model_dir = a.model_dir
    scratch = tempfile.TemporaryDirectory(prefix="agentrl_bench_")  # removed at the end of the run
    if model_dir is None:
        from agentrl.models.tiny import build_tiny_model

        model_dir = str(build_tiny_model(scratch.name, arch="qwen2"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    # median of uniform-free log-normal lengths = (min + max) / 2 in the stub's length model
    srv = start_stub_server(
        per_token_time=a.per_token_time,
        min_tokens=1,
        max_tokens=2 * a.median_tokens - 1,
        length_sigma=a.length_sigma,
        seed=0,
    )
    results: dict[str, dict[str, float]] = {}
    try:
        for name, eta in (("sync", 0), ("async_eta1", 1), ("async_eta2", 2)):
            results[name] = asyncio.run(run_mode(srv.url, tok, eta, a))
    finally:
        srv.stop()
        scratch.cleanup()
    sync = results["sync"]["wall_s"]
    print(
        json.dumps(
            {
                "bench": "async_vs_sync",
                "trained_trajectories_per_mode": a.steps * a.batch_size * a.group_size,
                "train_step_s": a.train_time,
                "wall_s": {k: round(v["wall_s"], 2) for k, v in results.items()},
                "speedup_eta1": round(sync / results["async_eta1"]["wall_s"], 2),
                "speedup_eta2": round(sync / results["async_eta2"]["wall_s"], 2),
                "staleness_mean": {k: round(v["staleness_mean"], 3) for k, v in results.items()},
                "staleness_max": {k: v["staleness_max"] for k, v in results.items()},
                "interrupted_requests": {k: v["interrupted_requests"] for k, v in results.items()},
                "workload": {
                    "per_token_time": a.per_token_time,
                    "median_tokens": a.median_tokens,
                    "length_sigma": a.length_sigma,
                    "tool_median_s": a.tool_median,
                    "tool_sigma": a.tool_sigma,
                    "batch_size": a.batch_size,
                    "group_size": a.group_size,
                    "steps": a.steps,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
