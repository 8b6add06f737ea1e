"""Chaos bench: N episodes of a multi-turn tool env against the embedded engine under seeded random faults;
nothing may be lost or trained twice, and every failure must say why.

The env (:class:`ChaosEnv`) answers each model turn with one tool call (a search against a retrieval
server, Python in a process sandbox, or an echo; the env draws which), and the run is trained by a
stand-in trainer loop (take a batch, "train", pause the rollout, push weights from disk as version + 1,
resume), so every weight update lands while episodes generate. The faults, all seeded:

* the engine process SIGKILLed while requests are in flight and restarted on its port (``--engine-kills``);
* ``env.step`` raising (``--env-raise``) and a tool call hanging past ``rollout.env_step_timeout``
  (``--tool-timeout``): the episode fails and is retried with a fresh env;
* a sandbox killed for memory (``--sandbox-oom``): the code allocates past the sandbox's limit;
* the verifier raising (``--verifier-raise``): the episode fails and is retried;
* the retrieval server answering HTTP 500 (``--retrieval-500``, a rate per request);
* weight updates landing mid-generation (every step: in-flight requests are aborted and resubmitted).

The report comes from the run's own accounting (:meth:`Orchestrator.accounting`, its outcomes and failed
attempts): ``drawn = trained + failed + dropped + in flight`` for groups and for episodes, ``lost`` and
``duplicated`` (both must be 0), every failed attempt's error text (counted by kind; none without
one), the faults injected, and the mean step time under faults against a clean run of the same bench
(all rates 0, no kills) on the same machine.

    python bench/chaos.py [--episodes 1000] [--seed 0] [--clean-episodes N] [--failures-out PATH]

Prints one JSON line (``--failures-out`` writes every failed attempt as JSON lines).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

FAULTS = ("env_raise", "tool_timeout", "sandbox_oom", "verifier_raise", "retrieval_500", "engine_kill")


@dataclass
class Faults:
    """Rates (per env step, per verifier call, per retrieval request) and what was injected."""

    seed: int = 0
    env_raise: float = 0.0
    tool_timeout: float = 0.0
    sandbox_oom: float = 0.0
    verifier_raise: float = 0.0
    retrieval_500: float = 0.0
    injected: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)  # tool calls made, by tool
    call_errors: Counter[str] = field(default_factory=Counter)  # tool calls that came back with an error
    envs: Counter[str] = field(default_factory=Counter)  # envs made per task: the attempt a fresh env is for


class ChaosError(RuntimeError):
    """A fault the bench injected on purpose."""


# ---- the retrieval server (a stand-in speaking the /retrieve protocol) ------------------------------------
async def start_retrieval(faults: Faults) -> tuple[web.AppRunner, str]:
    rng = random.Random(f"{faults.seed}/retrieval")

    async def retrieve(request: web.Request) -> web.Response:
        body = await request.json()
        if rng.random() < faults.retrieval_500:
            faults.injected["retrieval_500"] += 1
            return web.json_response({"error": "injected: retrieval server error"}, status=500)
        docs = [{"document": {"contents": f'"Doc"\nabout {q}'}, "score": 1.0} for q in body["queries"]]
        return web.json_response({"result": [docs] * len(body["queries"])})

    app = web.Application()
    app.router.add_post("/retrieve", retrieve)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


# ---- the env -----------------------------------------------------------------------------------------
def make_env_class(faults: Faults, retriever: Any, sandbox: Any, step_timeout: float) -> type:
    from agentrl.envs.base import Env, StepResult
    from agentrl.types import ToolCallRecord

    class ChaosEnv(Env):
        """Each model turn gets one tool call (search, python or echo, drawn by the env); faults at the
        bench's rates, drawn from (seed, task, attempt) so a retry meets other faults."""

        verifier = "chaos_bench"

        def __init__(self, turns: int = 3) -> None:
            self.turns = turns

        async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
            key = str(task["id"])
            self.rng = random.Random(f"{faults.seed}/{key}/{faults.envs[key]}")
            faults.envs[key] += 1
            self.turn = 0
            return [{"role": "user", "content": task["prompt"]}]

        async def step(self, action_text: str) -> StepResult:
            self.turn += 1
            r = self.rng.random()
            if r < faults.env_raise:
                faults.injected["env_raise"] += 1
                raise ChaosError("injected: env.step raised")
            if r < faults.env_raise + faults.tool_timeout:
                faults.injected["tool_timeout"] += 1
                await asyncio.sleep(step_timeout * 10)  # rollout.env_step_timeout ends it first
            tool = self.rng.choice(["search", "python", "echo"])
            call = ToolCallRecord(tool, {})
            t0 = time.monotonic()
            if tool == "search":
                call.arguments = {"query": action_text[-40:]}
                try:
                    call.result = await retriever.search(call.arguments["query"], 1)
                except Exception as err:  # the model sees the failure, as SearchEnv shows it
                    call.error = f"{type(err).__name__}: {err}"
            elif tool == "python":
                oom = self.rng.random() < faults.sandbox_oom
                faults.injected["sandbox_oom"] += oom
                code = "x = bytearray(1 << 30)\nprint(len(x))" if oom else f"print({self.turn} * 7)"
                call.arguments = {"code": code}
                res = await sandbox.run(code, timeout=5)
                call.result = res.as_text()
                if res.killed_reason is not None:
                    call.error = f"killed: {res.killed_reason}"
            else:
                call.result = action_text[-20:]
            call.latency_s = time.monotonic() - t0
            faults.calls[tool] += 1
            faults.call_errors[tool] += call.error is not None
            text = call.result if call.error is None else f"error: {call.error}"
            if self.turn >= self.turns:
                return StepResult(terminated=True, tool_calls=[call])
            return StepResult(observation=(text or "")[:200], tool_calls=[call])

    return ChaosEnv


def register_chaos_verifier(faults: Faults) -> None:
    from agentrl.rewards.base import register_verifier

    @register_verifier("chaos_bench", overwrite=True)
    async def chaos_bench(trajectory: Any, label: Any) -> float:
        """Length parity (variance within a group), raising at the bench's rate (drawn from the tokens,
        so a retry meets another draw)."""
        rng = random.Random(f"{faults.seed}/{trajectory.task_id}/{trajectory.response_ids}")
        if rng.random() < faults.verifier_raise:
            faults.injected["verifier_raise"] += 1
            raise ChaosError("injected: verifier raised")
        return float(len(trajectory.response_ids) % 2)


# ---- the engine ------------------------------------------------------------------------------------------
def build_models(tmp: Path, seed: int) -> list[Path]:
    """The tiny model and a perturbed copy: the two weight sets the stand-in trainer pushes in turn."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.models.tiny import build_tiny_model

    a = build_tiny_model(tmp / "weights_a", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    b = tmp / "weights_b"
    model.save_pretrained(b)
    for f in a.iterdir():  # the tokenizer's files
        if f.is_file() and not (b / f.name).exists():
            (b / f.name).write_bytes(f.read_bytes())
    return [a, b]


class Engine:
    """The embedded engine subprocess, killable and restartable on its port."""

    def __init__(self, weights: Path) -> None:
        from agentrl.embedded.launch import start_embedded_server

        self.start = start_embedded_server
        self.server = start_embedded_server(weights, max_batch_size=64)
        self.url = self.server.url

    def kill(self) -> None:
        """SIGKILL the engine's process group (what an OOM kill or a lost node does), reaped."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.server.process.pgid, signal.SIGKILL)
        self.server.stop()  # reaps it and removes its scratch dir

    def restart(self, weights: Path) -> None:
        self.server = self.start(weights, port=self.server.port, max_batch_size=64)

    def stop(self) -> None:
        self.server.stop()


# ---- one run -----------------------------------------------------------------------------------------------
async def run(
    args: argparse.Namespace, faults: Faults, kills: int, episodes: int, tmp: Path
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from agentrl.buffer import DataExhausted, NoProgressError
    from agentrl.engine.client import EngineClient
    from agentrl.engine.types import SamplingParams
    from agentrl.rollout import Orchestrator, RolloutConfig
    from agentrl.sandboxes.process import ProcessSandbox
    from agentrl.tools.search import RetrievalClient

    weights = build_models(tmp, args.seed)
    engine = await asyncio.to_thread(Engine, weights[0])
    retrieval, retrieval_url = await start_retrieval(faults)
    sandbox = ProcessSandbox(memory_mb=256, timeout=5)
    register_chaos_verifier(faults)
    group, batch = args.group_size, args.batch_size
    n_tasks = max(batch, episodes // group)
    cfg = RolloutConfig(
        group_size=group,
        batch_size=batch,
        max_staleness=1,
        max_concurrency=64,
        max_turns=3,
        max_total_tokens=512,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=16),
        env_step_timeout=args.step_timeout,
        max_retries=2,
        engine_retries=10,
        engine_retry_backoff=0.25,
        filter_zero_variance=True,
        epochs=1,
        seed=args.seed,
        record_outcomes=True,
    )
    tasks = [{"id": f"t{i}", "prompt": f"Task {i}: look it up, compute it, answer."} for i in range(n_tasks)]
    client = EngineClient(engine.url, timeout=30, max_retries=1, backoff=0.1)
    retriever = RetrievalClient(retrieval_url, topk=1, timeout=5.0, max_retries=1)
    env = make_env_class(faults, retriever, sandbox, args.step_timeout)
    orch = Orchestrator(cfg, client, AutoTokenizer.from_pretrained(weights[0]), env, tasks)
    steps_total = n_tasks // batch
    kill_rng = random.Random(f"{args.seed}/kills")
    # the kills fall in the first half of the steps: groups that fault out shorten the run, and a kill
    # planned past its last step would never happen
    window = range(1, max(2, steps_total // 2 + 1))
    kill_steps = set(kill_rng.sample(window, min(kills, len(window))))
    live = weights[0]  # what the engine holds (a restarted engine loads it)
    trained: list[str] = []
    trained_episodes = 0
    step_times: list[float] = []
    error = None
    t_start = time.monotonic()
    await orch.start()
    try:
        step = 0
        t_prev = time.monotonic()
        while True:
            try:
                b = await orch.buffer.get_batch(timeout=600)
            except DataExhausted:
                break
            trained += sorted({t.group_id for t in b})
            trained_episodes += len(b)
            step += 1
            await asyncio.sleep(args.train_time)  # "training", while the rollout generates beside it
            if step in kill_steps:  # the engine dies under in-flight requests; it is back seconds later
                faults.injected["engine_kill"] += 1
                await asyncio.to_thread(engine.kill)
                await asyncio.to_thread(engine.restart, live)
                await client.update_weight_version(str(orch.version))
            await until_generating(client)
            await orch.pause_for_update()  # the update lands mid-generation: in-flight requests abort
            live = weights[step % 2]
            await client.update_weights_from_disk(str(live), weight_version=str(orch.version + 1))
            await orch.resume_after_update(orch.version + 1)
            now = time.monotonic()
            step_times.append(now - t_prev)
            t_prev = now
    except NoProgressError as err:
        error = str(err)
    finally:
        await orch.stop()
        await client.close()
        await retriever.close()
        await retrieval.cleanup()
        await sandbox.close()
        engine.stop()
    wall = time.monotonic() - t_start
    out = report(orch, cfg, trained, trained_episodes, step_times, wall, faults, error)
    out["attempts"] = [
        {"uid": u, "sample": i, "attempt": a, "error": e} for u, i, a, e in orch.failed_attempts
    ]
    return out


async def until_generating(client: Any, timeout: float = 2.0) -> None:
    """Until the engine has a request in its batch (at most ``timeout`` s), so that the update after it
    lands mid-generation, as the fault means, and not in a gap between turns."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await client.server_info())[0].get("num_batch_requests", 0) > 0:
            return
        await asyncio.sleep(0.002)


def report(
    orch: Any,
    cfg: Any,
    trained: list[str],
    trained_episodes: int,
    step_times: list[float],
    wall: float,
    faults: Faults,
    error: str | None,
) -> dict[str, Any]:
    """The run's own accounting, for groups and for episodes."""
    acc = orch.accounting()
    n = cfg.group_size
    dropped = dict(orch.m.dropped)
    failed_groups = sum(v for k, v in dropped.items() if k.startswith("failed"))
    # an episode failed for good: its last attempt (max_retries) failed, or it gave up as stale
    final: dict[tuple[str, int], str] = {}
    for uid, i, attempt, err in orch.failed_attempts:
        if attempt == cfg.max_retries or err.startswith("stale"):
            final[(uid, i)] = err
    dropped_uids = {u for u, o in orch.outcomes if o.startswith("dropped:")}
    failed_eps = Counter(
        err.split(":", 1)[0].split()[0] for (u, _), err in final.items() if u in dropped_uids
    )
    failed_total = sum(failed_eps.values())
    episodes = {
        "drawn": acc["drawn"] * n,
        "trained": trained_episodes,
        "failed": dict(failed_eps),
        "dropped": len(dropped_uids) * n - failed_total,
        "in_flight": acc["in_flight"] * n,
    }
    episodes["lost"] = episodes["drawn"] - (
        episodes["trained"] + failed_total + episodes["dropped"] + episodes["in_flight"]
    )
    attempts = orch.failed_attempts
    kinds = Counter(err.split(":", 1)[0].split()[0] if err else "" for *_, err in attempts)
    examples: dict[str, str] = {}
    for *_, err in attempts:
        examples.setdefault(err.split(":", 1)[0].split()[0], err[:200])
    stats = orch.m.counters
    window = orch.m.snapshot(reset_window=False)  # the whole run (nothing read the window before)
    steady = sorted(step_times[1:]) or step_times  # the first step also warms the engine up
    return {
        "groups": {
            "drawn": acc["drawn"],
            "trained": acc["trained"],
            "failed": failed_groups,
            "dropped": {k: v for k, v in dropped.items()},
            "in_flight": acc["in_flight"],
            "lost": acc["drawn"] - acc["trained"] - sum(dropped.values()) - acc["in_flight"],
            "duplicated": len(trained) - len(set(trained)) + stats["duplicate_groups"],
        },
        "episodes": episodes,
        "failed_attempts": len(attempts),
        "failed_attempts_without_error": sum(not err.strip() for *_, err in attempts),
        "failed_attempts_by_kind": dict(kinds),
        "error_examples": examples,
        "faults_injected": {k: faults.injected[k] for k in FAULTS},
        "retries": stats["retries"],
        "engine_errors": stats["engine_errors"],
        "interrupted_requests": stats["interrupted_requests"],
        "tool_calls": dict(faults.calls),
        "tool_call_errors": dict(faults.call_errors),
        "steps": len(step_times),
        "mean_step_s": round(sum(steady) / max(1, len(steady)), 4),
        "median_step_s": round(steady[len(steady) // 2], 4) if steady else None,
        "generate_latency_mean_s": round(window["rollout/generate_latency_mean_s"], 4),
        "tool_latency_mean_s": round(window["rollout/tool_latency_mean_s"], 4),
        "wall_s": round(wall, 2),
        "no_progress": error,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=1000, help="episodes under faults (tasks x group size)")
    ap.add_argument(
        "--clean-episodes", type=int, default=None, help="episodes of the clean run (default: same; 0: none)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4, help="groups per step")
    ap.add_argument("--env-raise", type=float, default=0.03, help="rate per env step")
    ap.add_argument("--tool-timeout", type=float, default=0.02, help="rate per env step")
    ap.add_argument("--sandbox-oom", type=float, default=0.1, help="rate per python call")
    ap.add_argument("--verifier-raise", type=float, default=0.03, help="rate per verifier call")
    ap.add_argument("--retrieval-500", type=float, default=0.2, help="rate per retrieval request")
    ap.add_argument(
        "--engine-kills",
        type=int,
        default=None,
        help="engine kills, in the first half of the steps (default: one per 20 steps)",
    )
    ap.add_argument("--step-timeout", type=float, default=1.0, help="rollout.env_step_timeout, seconds")
    ap.add_argument(
        "--train-time", type=float, default=0.05, help="seconds the stand-in trainer takes a step"
    )
    ap.add_argument("--failures-out", default=None, help="write every failed attempt here (JSON lines)")
    args = ap.parse_args()
    steps = args.episodes // args.group_size // args.batch_size
    kills = args.engine_kills if args.engine_kills is not None else max(1, steps // 20)
    faulty = Faults(
        args.seed,
        args.env_raise,
        args.tool_timeout,
        args.sandbox_oom,
        args.verifier_raise,
        args.retrieval_500,
    )
    clean_n = args.episodes if args.clean_episodes is None else args.clean_episodes
    with tempfile.TemporaryDirectory(prefix="agentrl-chaos-") as tmp:
        clean = (
            asyncio.run(run(args, Faults(args.seed), 0, clean_n, Path(tmp) / "clean")) if clean_n else None
        )
        chaos = asyncio.run(run(args, faulty, kills, args.episodes, Path(tmp) / "chaos"))
    attempts = chaos.pop("attempts")
    if args.failures_out:
        Path(args.failures_out).write_text("".join(json.dumps(a) + "\n" for a in attempts))
    out = {
        "bench": "chaos",
        "n_episodes": args.episodes,
        "seed": args.seed,
        "cpus": os.cpu_count(),
        **chaos,
        "clean_steps": clean["steps"] if clean else None,
        "clean_mean_step_s": clean["mean_step_s"] if clean else None,
        "clean_median_step_s": clean["median_step_s"] if clean else None,
        "clean_wall_s": clean["wall_s"] if clean else None,
        "step_time_ratio": round(chaos["mean_step_s"] / clean["mean_step_s"], 2) if clean else None,
    }
    print(json.dumps(out))
    ok = out["groups"]["lost"] == 0 and out["groups"]["duplicated"] == 0 and out["episodes"]["lost"] == 0
    sys.exit(0 if ok and not out["failed_attempts_without_error"] and out["no_progress"] is None else 1)


if __name__ == "__main__":
    main()
