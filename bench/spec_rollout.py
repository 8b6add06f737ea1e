"""Benchmark: speculative decoding on Search-R1 episodes, beside the same episodes without it.

A Search-R1 policy plays ``SearchEnv`` episodes (its searches answered by the bm25s /retrieve server over
its world's corpus) against an embedded engine server: first a plain server, then a speculating one
(``--spec-args``), one after the other on the same device. The policy and its world come from a run
config (``--config``: the warm start and world its bootstrap builds, cached where the run caches them)
or are named (``--model``, ``--world``); ``--checkpoint`` plays the policy a run trained instead (the
newest one-rank trainer checkpoint under that folder), which is what a run's later steps generate.

Each concurrency C in ``--concurrency`` plays ``--tasks`` training tasks ``--group`` times each (a GRPO
group's samples) with at most C episodes in flight, with the config's rollout settings (sampling,
turns, tokens). Every concurrency takes tasks of its own, and the warm-up (``--warmup-tasks``, so that no
kernel compiles and no graph is captured inside a timed window) others again: a speculating server
drafts from what it generated before, and the same episodes again would be drafted from themselves.
Requests are seeded by episode and turn (as in deterministic runs), so with exact acceptance both
servers play the same episodes: ``same_tokens`` is the share of episodes whose tokens came out the same
on both (on a batch-invariant server, ``--server-args --batch-invariant``, speculation changes no token
and it is 1.0).

For each concurrency and server: the window's wall seconds, generated tokens and their rate, turns and
tokens per turn, exact match, failed episodes, and the engine's account of the window
(:mod:`agentrl.engine.account`: device busy shares, decode steps and rows, and for the speculating
server its verify steps, accepted tokens per verified request and acceptance rate); then
``ratio_spec_over_plain`` of the generated tokens/s. One JSON line.

    python bench/spec_rollout.py                                       # the CPU demo's warm start
    python bench/spec_rollout.py --config examples/search_r1/config_gpu.yaml --concurrency 64,256
    python bench/spec_rollout.py --config examples/search_r1/config_gpu.yaml \
        --checkpoint runs/search_r1_gpu/checkpoints
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_SPEC = "--speculative ngram --spec-k 4 --spec-ngram 3 --spec-min-ngram 2 --spec-shared-tokens 200000"


@dataclass
class Workload:
    """What both servers play: the policy, the run's config, its env, and the tasks of the warm-up and of
    each window."""

    model: Path
    tok: Any
    cfg: Any
    env_factory: Any
    slices: list[list[dict]]


def prepare(a: argparse.Namespace, tmp: Path) -> tuple[Any, Path, list[dict], str]:
    """The run config, the model dir the servers load, its training tasks and the corpus, as the run's
    recipe prepares them (``--model`` and ``--world`` as overrides of the config)."""
    from agentrl.examples.search_r1.recipe import SearchR1Recipe
    from agentrl.recipe import load_run_config, make_recipe

    overrides = list(a.overrides)
    if a.model:
        overrides.append(f"model_path={a.model}")
    if a.world:
        overrides += [f"data.path={a.world}", f"data.corpus={Path(a.world) / 'corpus.jsonl'}"]
    cfg = load_run_config(a.config, overrides)
    recipe = make_recipe(cfg)
    if not isinstance(recipe, SearchR1Recipe):
        sys.exit(f"{a.config}: not a Search-R1 config (recipe {cfg.recipe})")
    model, train, _ = recipe.prepare()
    if a.checkpoint:
        from agentrl.examples.search_r1.evaluate import checkpoint_to_hf

        model = checkpoint_to_hf(a.checkpoint, model, tmp / "trained")
    return cfg, Path(model), list(train), recipe.corpus


async def play(
    url: str, w: Workload, tasks: list[dict], group: int, concurrency: int
) -> tuple[list[Any], float, dict[str, float]]:
    """Every task ``group`` times, at most ``concurrency`` in flight: the episodes, the seconds they took
    and the engine's account of that window."""
    from agentrl.engine.account import where_time_went
    from agentrl.engine.client import EngineClient
    from agentrl.metrics import engine_metrics
    from agentrl.rollout import Orchestrator

    episodes = [t for t in tasks for _ in range(group)]  # siblings side by side, as a group runs
    async with EngineClient(url, timeout=3600) as client:
        orch = Orchestrator(w.cfg.rollout, client, w.tok, w.env_factory, episodes, deterministic=True)
        before = await engine_metrics(client)
        t0 = time.perf_counter()
        trajs = await orch.evaluate(episodes, w.cfg.rollout.sampling, concurrency)
        seconds = time.perf_counter() - t0
        account = where_time_went(before, await engine_metrics(client), seconds)
    return trajs, seconds, account


def figures(trajs: list[Any], seconds: float, account: dict[str, float]) -> dict[str, Any]:
    """What one server did in one window."""
    from agentrl.examples.search_r1.recipe import exact_match
    from agentrl.types import Status

    tokens = sum(sum(t.loss_mask) for t in trajs)
    turns = sum(len(t.turns) for t in trajs)
    # a turn's first token comes from its prefill step; the rest from decode (and verify) steps
    stepping = (account.get("decode_busy_frac", 0.0) + account.get("verify_busy_frac", 0.0)) * seconds
    return {
        "episodes": len(trajs),
        "wall_s": round(seconds, 3),
        "generated_tokens": tokens,
        "tok_s": round(tokens / seconds, 1),
        "decode_tok_s": round((tokens - turns) / stepping, 1) if stepping > 0 else None,
        "turns_per_episode": round(turns / max(len(trajs), 1), 2),
        "tokens_per_turn": round(tokens / max(turns, 1), 1),
        "exact_match": round(exact_match(trajs), 3),
        "failed": sum(t.status == Status.FAILED for t in trajs),
        "engine_time": account,
    }


def ratio(x: float | None, y: float | None) -> float | None:
    """x / y where both are known."""
    return round(x / y, 3) if x and y else None


def serve(
    a: argparse.Namespace, w: Workload, spec: bool
) -> tuple[dict[str, dict[str, Any]], dict[int, list[list[int]]]]:
    """One server (speculating when ``spec``): its warm-up, then a window per concurrency; the figures and
    each window's response tokens."""
    from agentrl.embedded.launch import start_embedded_server

    extra = shlex.split(a.server_args) + (shlex.split(a.spec_args) if spec else [])
    server = start_embedded_server(
        w.model,
        device=a.device or w.cfg.engine.device,
        dtype=a.dtype or w.cfg.engine.dtype,
        max_batch_size=max(a.concurrency),
        timeout=1800,
        log_file=a.log_dir / ("spec.log" if spec else "plain.log") if a.log_dir else None,
        extra_args=extra,
    )
    rows, tokens = {}, {}
    try:
        asyncio.run(play(server.url, w, w.slices[0], a.group, max(a.concurrency)))
        for c, tasks in zip(a.concurrency, w.slices[1:], strict=True):
            trajs, seconds, account = asyncio.run(play(server.url, w, tasks, a.group, c))
            rows[str(c)] = figures(trajs, seconds, account)
            tokens[c] = [t.response_ids for t in trajs]
    finally:
        server.stop()
    return rows, tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="examples/search_r1/config.yaml", help="a Search-R1 run config")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    p.add_argument("--model", default=None, help="the policy's HF dir (default: the config's warm start)")
    p.add_argument("--world", default=None, help="its world dir (default: the config's)")
    p.add_argument("--checkpoint", default=None, help="a run's checkpoints dir: play its newest policy")
    p.add_argument("--concurrency", default="64,256", help="episodes in flight, one window each")
    p.add_argument("--tasks", type=int, default=32, help="training tasks a window (each --group times)")
    p.add_argument("--group", type=int, default=8, help="episodes a task (a GRPO group)")
    p.add_argument("--warmup-tasks", type=int, default=8, help="tasks of the warm-up before the windows")
    p.add_argument("--spec-args", default=DEFAULT_SPEC, help="the speculating server's flags")
    p.add_argument("--server-args", default="", help="flags for both servers (quoted)")
    p.add_argument("--device", default=None, help="default: the config's engine.device")
    p.add_argument("--dtype", default=None, help="default: the config's engine.dtype")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the servers' logs here")
    a = p.parse_args(argv)
    try:
        a.concurrency = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency: comma-separated integers, got {a.concurrency!r}")
    if min(a.concurrency) < 1 or a.tasks < 1 or a.group < 1 or a.warmup_tasks < 1:
        p.error("--concurrency, --tasks, --group and --warmup-tasks must be at least 1")

    from agentrl.chat import ChatTokenizer
    from agentrl.envs import make_env
    from agentrl.examples.search_r1.retrieval_workers import start_retrieval_server

    if a.log_dir:
        a.log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-spec-rollout-") as tmp:
        cfg, model, tasks, corpus = prepare(a, Path(tmp))
        need = a.warmup_tasks + a.tasks * len(a.concurrency)
        if len(tasks) < need:
            sys.exit(f"{len(tasks)} training tasks; the warm-up and windows need {need}")
        w, n = a.warmup_tasks, a.tasks
        slices = [tasks[:w], *(tasks[w + i * n : w + (i + 1) * n] for i in range(len(a.concurrency)))]
        from transformers import AutoTokenizer

        tok = ChatTokenizer(AutoTokenizer.from_pretrained(model))
        with start_retrieval_server(corpus, workers=2) as retrieval:
            env_kwargs = {"retrieval_url": retrieval.url, "topk": cfg.retrieval.topk, **cfg.env.kwargs}
            env_factory = functools.partial(make_env, cfg.env.name, **env_kwargs)
            work = Workload(model, tok, cfg, env_factory, slices)
            plain, plain_tokens = serve(a, work, spec=False)
            spec, spec_tokens = serve(a, work, spec=True)
    results = {}
    for c in a.concurrency:
        base, fast = plain[str(c)], spec[str(c)]
        same = sum(x == y for x, y in zip(plain_tokens[c], spec_tokens[c], strict=True))
        results[str(c)] = {
            "plain": base,
            "spec": fast,
            "ratio_spec_over_plain": ratio(fast["tok_s"], base["tok_s"]),
            "decode_ratio_spec_over_plain": ratio(fast["decode_tok_s"], base["decode_tok_s"]),
            "same_tokens": round(same / max(len(plain_tokens[c]), 1), 3),
        }
    print(
        json.dumps(
            {
                "bench": "spec_rollout",
                "config": a.config,
                "policy": "checkpoint" if a.checkpoint else ("model" if a.model else "warm start"),
                "device": a.device or cfg.engine.device,
                "dtype": a.dtype or cfg.engine.dtype,
                "tasks": a.tasks,
                "group": a.group,
                "spec_args": a.spec_args,
                "server_args": a.server_args,
                "results": results,
                "cpus": os.cpu_count(),
                "load_1min": round(os.getloadavg()[0], 2),
                "python": platform.python_version(),
            }
        )
    )


if __name__ == "__main__":
    main()
