"""A reward verifier and an env that names it: the model adds two numbers, the verifier scores the answer.

Score a hand-written answer:  python -m agentrl.examples.custom_verifier
Train with it: env: {name: agentrl.examples.custom_verifier:AddEnv} (the env names its verifier), or
rollout.verifier: agentrl.examples.custom_verifier:last_number with any other env.
The README shows the lines between the [readme:verifier] markers; tests/test_docs.py checks they match.
"""

from __future__ import annotations

# [readme:verifier]
import re
from typing import Any

from agentrl.envs import Env, StepResult
from agentrl.rewards import RewardResult, register_verifier
from agentrl.types import Trajectory


@register_verifier("last_number")
async def last_number(trajectory: Trajectory, label: Any) -> RewardResult:
    """1 when the last number the model wrote equals the label (the part: did it write one at all)."""
    numbers = re.findall(r"-?\d+", trajectory.assistant_text())  # the model's own text only
    hit = bool(numbers) and numbers[-1] == str(label)
    return RewardResult(reward=float(hit), parts={"wrote_number": float(bool(numbers))})


class AddEnv(Env):
    verifier = "last_number"  # scores this env's episodes; rollout.verifier in the run config overrides it

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        return StepResult(terminated=True)  # one turn: the answer is in, the verifier takes it from here


# [readme:verifier-end]


async def score(text: str, label: Any) -> Trajectory:
    """A one-turn trajectory with ``text`` as the model's answer, scored the way the rollout scores it."""
    from agentrl.rewards import run_verifier

    traj = Trajectory(task_id="example", group_id="example", prompt_ids=[0])
    traj.append_model_tokens([1], [0.0], 0, text=text)
    await run_verifier("last_number", traj, label)
    return traj


if __name__ == "__main__":
    import asyncio

    t = asyncio.run(score("3 + 4 = 7", 7))
    print(t.status.value, t.reward, t.reward_parts)
