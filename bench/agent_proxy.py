"""Agent episodes through the recording proxy vs the same episodes as an Env class, in the same run.

Both run through the real orchestrator (``evaluate``: no staleness gating) against one embedded engine
(tiny model, CPU) over loopback HTTP: 3 model turns per episode, a user message of feedback between
turns, EOS ignored so both sample the same number of tokens. The Env is a plain ``reset``/``step``
class; the agent is the same loop written on the openai SDK, each call going agent -> openai SDK ->
proxy (chat template, tool-call parsing, recording; in process) -> engine.

Two cases, same command, one JSON line. ``overhead``: the default tiny model (hidden 64, 2 layers) and
16 tokens per turn, so a decode step takes about a millisecond and the ratio is mostly the SDK's and
the proxy's own cost. ``generation``: a larger tiny model (hidden 384, 6 layers) and 64 tokens per
turn, so a decode step of 16 sequences costs tens of milliseconds, as with a real model on a GPU; each
case reports its measured ``ms_per_decode_step``. Figures: docs/results/agent-proxy.md. Env and
agent passes alternate, best of ``--repeats`` each (the machine may be shared); ``decode_steps`` are
the engine's, for the same passes (agent calls that arrive staggered fill its batches less).

    python bench/agent_proxy.py [--episodes 64] [--concurrency 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from typing import Any

from agentrl.envs import Env, StepResult

TURNS = 3


class FeedbackEnv(Env):
    """Three model turns with a feedback message after each of the first two."""

    scores_itself = True

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.turn = 0
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        if self.turn >= TURNS:
            return StepResult(reward=1.0, terminated=True)
        return StepResult(observation=f"feedback {self.turn}", observation_role="user")


async def feedback_agent(task: dict[str, Any], client: Any) -> float:
    """The same episode on the openai SDK."""
    messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
    for turn in range(1, TURNS + 1):
        r = await client.chat.completions.create(model="policy", messages=messages)
        if turn < TURNS:
            messages += [r.choices[0].message, {"role": "user", "content": f"feedback {turn}"}]
    return 1.0


async def run(
    url: str, model_dir: str, agent: bool, tokens: int, a: argparse.Namespace
) -> tuple[float, float, int]:
    """One pass: wall seconds and this process's CPU seconds for ``a.episodes`` episodes, and their
    response tokens."""
    from transformers import AutoTokenizer

    from agentrl.engine.client import EngineClient
    from agentrl.engine.types import SamplingParams
    from agentrl.envs import AgentEnv
    from agentrl.rollout import Orchestrator, RolloutConfig
    from agentrl.types import Status

    sp = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
    cfg = RolloutConfig(
        max_turns=TURNS, max_total_tokens=1024, eval_sampling=sp, max_concurrency=a.concurrency
    )
    tasks = [{"prompt": f"task number {i}: say something", "label": "x"} for i in range(a.episodes)]
    factory = (lambda: AgentEnv(feedback_agent)) if agent else FeedbackEnv
    client = EngineClient(url, timeout=600)
    orch = Orchestrator(cfg, client, AutoTokenizer.from_pretrained(model_dir), factory, tasks)
    try:
        await orch.evaluate(tasks[:4])  # warm: proxy start, connections, caches
        t0, c0 = time.perf_counter(), time.process_time()
        trajs = await orch.evaluate(tasks)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        await orch.stop()
        await client.close()
    bad = [t for t in trajs if t.status != Status.COMPLETED or t.num_turns != TURNS]
    if bad:
        raise RuntimeError(f"{len(bad)} episodes did not complete 3 turns: {bad[0].error}")
    return dt, cpu, sum(len(t.response_ids) for t in trajs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES), help="which cases, comma-separated")
    ap.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="torch threads of the engine process (OMP_NUM_THREADS); 1 leaves "
        "a core to the orchestrator, and on a loaded machine keeps OpenMP's "
        "spinning threads from making the engine's speed swing tenfold",
    )
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.engine_threads)  # inherited by the engine's process
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-") as scratch:
        cases = {name: case(scratch, name, a) for name in a.cases.split(",")}
    print(
        json.dumps(
            {
                "bench": "agent_proxy",
                "episodes": a.episodes,
                "concurrency": a.concurrency,
                "turns": TURNS,
                "engine_threads": a.engine_threads,
                **cases,
            }
        )
    )


# name: (tiny model shape, sampled tokens per turn)
CASES: dict[str, tuple[dict[str, int], int]] = {
    "overhead": ({}, 16),
    "generation": ({"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6}, 64),
}


def case(scratch: str, name: str, a: argparse.Namespace) -> dict[str, Any]:
    import urllib.request

    from agentrl.embedded.launch import start_embedded_server
    from agentrl.models.tiny import build_tiny_model

    shape, tokens = CASES[name]
    model_dir = str(build_tiny_model(os.path.join(scratch, name), arch="qwen2", **shape))

    def decode_steps(url: str) -> int:
        with urllib.request.urlopen(f"{url}/get_server_info") as resp:
            return int(json.loads(resp.read())["decode_steps"])

    secs: dict[str, list[float]] = {"env": [], "agent": []}
    cpu: dict[str, list[float]] = {"env": [], "agent": []}
    steps: dict[str, list[int]] = {"env": [], "agent": []}
    seen: dict[str, int] = {}
    with start_embedded_server(model_dir, max_batch_size=max(16, a.concurrency)) as srv:
        for _ in range(a.repeats):
            for kind in ("env", "agent"):
                before = decode_steps(srv.url)
                dt, c, seen[kind] = asyncio.run(run(srv.url, model_dir, kind == "agent", tokens, a))
                secs[kind].append(dt)
                cpu[kind].append(c)
                steps[kind].append(decode_steps(srv.url) - before)
    best = {k: min(v) for k, v in secs.items()}
    fastest_env = secs["env"].index(best["env"])
    return {
        "model": {"hidden_size": 64, "num_hidden_layers": 2, **shape},
        "tokens_per_turn": tokens,
        "ms_per_decode_step": round(1000 * best["env"] / steps["env"][fastest_env], 2),
        "env_episodes_per_s": round(a.episodes / best["env"], 2),
        "agent_episodes_per_s": round(a.episodes / best["agent"], 2),
        "ratio_agent_over_env": round(best["env"] / best["agent"], 3),
        "env_runs": [round(a.episodes / x, 2) for x in secs["env"]],
        "agent_runs": [round(a.episodes / x, 2) for x in secs["agent"]],
        "decode_steps": steps,
        # the rollout process's CPU per model call (orchestrator, env or agent + SDK + proxy), best pass
        "rollout_cpu_ms_per_call": {
            k: round(1000 * min(v) / (a.episodes * TURNS), 3) for k, v in cpu.items()
        },
        "response_tokens": seen,
    }


if __name__ == "__main__":
    main()
