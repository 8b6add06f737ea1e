"""A custom env in under 60 lines: guess a secret number, with feedback after every guess.

Run one episode through the contract checker:  python -m agentrl.examples.custom_env
Train on it by naming it in the config: env: {name: agentrl.examples.custom_env:GuessEnv}, as
examples/custom_env.yaml does (or env: guess_number once this module is imported).
The README shows the lines between the [readme:env] markers; tests/test_docs.py checks they match.
"""

from __future__ import annotations

# [readme:env]
import re
from typing import Any

from agentrl.envs import Env, StepResult, register_env


@register_env("guess_number")
class GuessEnv(Env):
    """The model guesses an integer in [lo, hi]; it hears "higher"/"lower"; reward 1 on a hit, else 0."""

    stop = ["</guess>"]  # the engine stops after each guess
    scores_itself = True  # every ending below carries a reward, so no verifier is needed

    def __init__(self, max_turns: int = 6) -> None:
        self.max_turns = max_turns

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.secret, self.turn = int(task["label"]), 0
        lo, hi = task.get("lo", 1), task.get("hi", 100)
        return [{"role": "user", "content": f"Guess my number in [{lo}, {hi}]. Answer as <guess>N</guess>."}]

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        m = re.search(r"<guess>\s*(-?\d+)\s*(?:</guess>|$)", action_text)
        if m is None:
            feedback = "Please answer as <guess>N</guess>."
        elif int(m.group(1)) == self.secret:
            return StepResult(reward=1.0, terminated=True, info={"turns": self.turn})
        else:
            feedback = "higher" if int(m.group(1)) < self.secret else "lower"
        if self.turn >= self.max_turns:  # out of turns: the episode ends unsolved
            return StepResult(reward=0.0, truncated=True, info={"turns": self.turn})
        return StepResult(observation=feedback, observation_role="user")


# [readme:env-end]


if __name__ == "__main__":
    import asyncio

    from agentrl.envs import check_env

    print(asyncio.run(check_env(GuessEnv, {"label": 42}, ["<guess>50</guess>", "<guess>42</guess>"])) or "ok")
