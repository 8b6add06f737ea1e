"""A custom tool env: convert units with a calculator tool; a registered verifier gives partial credit.

Check one episode:  python -m agentrl.examples.custom_tool_env.env
Train it (warm start first, then RL): python train_async.py --config examples/custom_tool_env/config.yaml
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

from agentrl.envs import ToolEnv
from agentrl.rewards import RewardResult, register_verifier
from agentrl.tools import tool
from agentrl.types import Trajectory

# how many of the second unit make one of the first
FACTORS = {
    ("km", "m"): 1000,
    ("m", "cm"): 100,
    ("cm", "mm"): 10,
    ("ft", "in"): 12,
    ("kg", "g"): 1000,
    ("lb", "oz"): 16,
    ("h", "min"): 60,
    ("min", "s"): 60,
    ("day", "h"): 24,
    ("l", "ml"): 1000,
}
SYSTEM_PROMPT = "Convert units: call the calculator, then answer with the number and the unit."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


@tool(timeout=5)
async def calculator(expression: str) -> str:
    """Evaluate arithmetic.

    Args:
        expression: numbers with + - * / ( )
    """

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return f"{ev(ast.parse(expression, mode='eval').body):.6g}"  # errors reach the model as error text


class UnitConversionEnv(ToolEnv):
    """The calculator tool over up to ``max_turns`` turns; a turn without a call is the answer."""

    verifier = "unit_conversion"

    def __init__(self, max_turns: int = 3) -> None:
        super().__init__([calculator], system_prompt=SYSTEM_PROMPT, max_turns=max_turns)


@register_verifier("unit_conversion")
async def unit_conversion(trajectory: Trajectory, label: Any) -> RewardResult:
    """1 for the right number, partial credit 1 - relative error for a near one, 0 for no answer."""
    final = [t.text for t in trajectory.turns if t.role == "assistant"][-1:]
    numbers = re.findall(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?", final[0]) if final else []
    called = any(c.name == "calculator" for t in trajectory.turns for c in t.tool_calls)
    if not numbers or "<tool_call>" in final[0]:
        return RewardResult(reward=0.0, parts={"answered": 0.0, "called_tool": float(called)})
    error = abs(float(numbers[-1]) - float(label)) / max(abs(float(label)), 1e-9)
    reward = 1.0 if error < 1e-4 else max(0.0, 1.0 - error)
    return RewardResult(reward=reward, parts={"answered": 1.0, "called_tool": float(called)})


def make_tasks(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` conversions (either direction of a unit pair), with the exact answer as the label."""
    rng, tasks = random.Random(seed), []
    for i in range(n):
        (big, small), factor = rng.choice(sorted(FACTORS.items()))
        value = rng.randint(2, 99)
        src, dst, answer = (
            (big, small, value * factor) if rng.random() < 0.5 else (small, big, value / factor)
        )
        prompt = f"Convert {value} {src} to {dst}."
        tasks.append(
            {"id": f"conv{i}", "prompt": prompt, "label": answer, "value": value, "from": src, "to": dst}
        )
    return tasks


if __name__ == "__main__":
    import asyncio
    import json

    from agentrl.envs import check_env

    task = make_tasks(1, seed=0)[0]
    args = {"expression": f"{task['value']} * 1"}
    call = f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': args})}</tool_call>"
    print(asyncio.run(check_env(UnitConversionEnv, task, [call, "42"])) or "ok")
