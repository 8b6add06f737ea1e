"""A tool-using agent in plain openai-SDK code; agentrl trains the model behind ``client`` on its calls.

python train_async.py --config examples/openai_agent.yaml
"""

import json
import re

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


async def agent(task: dict, client: openai.AsyncOpenAI, max_calls: int = 3) -> float:
    """Answer ``task["prompt"]`` with the add tool; reward 1 for the right number, 0.2 for any number."""
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(max_calls):
        r = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=48
        )
        msg = r.choices[0].message
        messages.append(msg)
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = str(int(args["a"]) + int(args["b"]))
            except (KeyError, TypeError, ValueError) as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+", msg.content or "")
    if numbers and numbers[-1] == str(task["label"]):
        return 1.0
    return 0.2 if numbers else 0.0
