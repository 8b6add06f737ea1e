"""Agent episodes through the recording proxy vs the same episodes as an Env class, in the same run.

Both run through the real orchestrator (``evaluate``: no staleness gating) against one embedded engine
(tiny model, CPU) over loopback HTTP: 3 model turns per episode, 16 sampled tokens per turn (EOS
ignored, so both sample the same number of tokens), a user message of feedback between turns. The Env
is a plain ``reset``/``step`` class; the agent is the same loop written on the openai SDK, each call
going agent -> proxy (chat template, tool-call parsing, recording) -> engine. Prints one JSON line with
episodes/s of each and their ratio (goal >= 0.8). Env and agent passes alternate, best of ``--repeats``.

    python bench/agent_proxy.py [--episodes 64] [--concurrency 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def run(url: str, model_dir: str, agent: bool, a: argparse.Namespace) -> tuple[float, int]:
    from transformers import AutoTokenizer

    from agentrl.engine.client import EngineClient
    from agentrl.engine.types import SamplingParams
    from agentrl.envs import AgentEnv
    from agentrl.rollout import Orchestrator, RolloutConfig
    from agentrl.types import Status

    sp = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    cfg = RolloutConfig(
        max_turns=TURNS, max_total_tokens=1024, eval_sampling=sp, max_concurrency=a.concurrency
    )
    tasks = [{"prompt": f"task number {i}: say something", "label": "x"} for i in range(a.episodes)]
    factory = (lambda: AgentEnv(feedback_agent)) if agent else FeedbackEnv
    client = EngineClient(url, timeout=600)
    orch = Orchestrator(cfg, client, AutoTokenizer.from_pretrained(model_dir), factory, tasks)
    try:
        await orch.evaluate(tasks[:4])  # warm: proxy start, connections, caches
        t0 = time.perf_counter()
        trajs = await orch.evaluate(tasks)
        dt = time.perf_counter() - t0
    finally:
        await orch.stop()
        await client.close()
    bad = [t for t in trajs if t.status != Status.COMPLETED or t.num_turns != TURNS]
    if bad:
        raise RuntimeError(f"{len(bad)} episodes did not complete 3 turns: {bad[0].error}")
    return a.episodes / dt, sum(len(t.response_ids) for t in trajs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default=None)
    a = ap.parse_args()
    from agentrl.engine.embedded_server import start_embedded_server

    with tempfile.TemporaryDirectory(prefix="agentrl-bench-") as scratch:
        model_dir = a.model_dir
        if model_dir is None:
            from agentrl.models.tiny import build_tiny_model

            model_dir = str(build_tiny_model(scratch, arch="qwen2"))
        with start_embedded_server(model_dir, max_batch_size=max(16, a.concurrency)) as srv:
            env_eps, agent_eps, tokens = [], [], {}
            for _ in range(a.repeats):
                r, tokens["env"] = asyncio.run(run(srv.url, model_dir, False, a))
                env_eps.append(r)
                r, tokens["agent"] = asyncio.run(run(srv.url, model_dir, True, a))
                agent_eps.append(r)
    env_best, agent_best = max(env_eps), max(agent_eps)
    print(
        json.dumps(
            {
                "bench": "agent_proxy",
                "episodes": a.episodes,
                "concurrency": a.concurrency,
                "turns": TURNS,
                "env_episodes_per_s": round(env_best, 2),
                "agent_episodes_per_s": round(agent_best, 2),
                "ratio_agent_over_env": round(agent_best / env_best, 3),
                "goal": 0.8,
                "env_runs": [round(x, 2) for x in env_eps],
                "agent_runs": [round(x, 2) for x in agent_eps],
                "response_tokens": tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
