"""MathEnv: single-turn math. The model answers once; the ``math`` verifier (math-verify) scores it."""

from __future__ import annotations

from typing import Any

from .base import Env, Message, StepResult
from .registry import register_env
from .tool_env import task_messages

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@register_env("math")
class MathEnv(Env):
    """Task: ``{"prompt": question or messages, "label": gold answer}``. One step, then terminated."""

    verifier = "math"

    def __init__(self, instruction: str | None = INSTRUCTION, system_prompt: str | None = None) -> None:
        self.instruction = instruction
        self.system_prompt = system_prompt

    def fork(self) -> MathEnv:
        """One turn, no state: a fork is a new env with the same settings."""
        return MathEnv(self.instruction, self.system_prompt)

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        msgs = task_messages(task, self.system_prompt)
        if self.instruction and isinstance(task.get("prompt", task.get("question")), str):
            msgs[-1]["content"] = f"{msgs[-1]['content'].rstrip()}\n{self.instruction}"
        return msgs

    async def step(self, action_text: str) -> StepResult:
        return StepResult(None, terminated=True, info={"response_chars": len(action_text)})
