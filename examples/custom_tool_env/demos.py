"""Demonstrations for the warm start: a scripted expert plays the env, and each episode becomes one chat
conversation (OpenAI message format, with the env's tool schemas) for ``agentrl.sft``.

Write them:  python -m agentrl.examples.custom_tool_env.demos --out demos.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from agentrl.sft import record_demos, write_demos

from .env import FACTORS, UnitConversionEnv, make_tasks


# [readme:expert]
def expert(task: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """The action a good policy takes: call the calculator with the right factor, then read its result out.
    The call is written exactly as the model should write it (the Hermes ``<tool_call>`` format)."""
    if messages[-1]["role"] == "tool":
        return f"{messages[-1]['content']} {task['to']}"
    pair = (task["from"], task["to"])
    op, factor = ("*", FACTORS[pair]) if pair in FACTORS else ("/", FACTORS[pair[::-1]])
    call = {"name": "calculator", "arguments": {"expression": f"{task['value']} {op} {factor}"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


# [readme:expert-end]


def make_demos(n: int = 2000, seed: int = 1000) -> list[dict[str, Any]]:
    """``n`` expert conversations on their own tasks (``seed`` differs from the training tasks')."""
    return asyncio.run(record_demos(UnitConversionEnv, make_tasks(n, seed), expert))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="demos.jsonl", help="JSONL file to write")
    p.add_argument("-n", type=int, default=2000, help="demonstrations")
    args = p.parse_args()
    print(write_demos(args.out, make_demos(args.n)))
