"""ToolEnv: a multi-turn env over any list of tools called in the Hermes/Qwen ``<tool_call>`` format;
PythonToolEnv: the code-interpreter case (a sandboxed ``python`` tool, then an answer).

Each model turn is parsed; every call runs (concurrently) and comes back as one ``tool`` message per
call. Malformed calls, unknown tools, bad arguments, tool exceptions and timeouts all come back as error
text for the model; nothing escapes the episode. A turn without any call is the final answer. The env
passes the tools' OpenAI schemas as ``env.tools`` so the chat template can render them, and reports each
call it ran (and each malformed one, with no name) in ``StepResult.tool_calls``.

Tools can be named in a run config, with their arguments (:mod:`agentrl.tools.registry`)::

    env:
      name: tool
      kwargs: {tools: [python, {search: {url: "http://127.0.0.1:8000"}}, my_tools:convert]}
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

from agentrl.sandboxes.base import Sandbox
from agentrl.tools.base import Tool, ToolResult, ToolSet, call_record, truncate
from agentrl.tools.parsers import HermesParser
from agentrl.tools.python import python_tool
from agentrl.tools.registry import resolve_tools
from agentrl.types import ToolCallRecord

from .base import Env, Message, StepResult
from .registry import register_env


def task_messages(task: dict[str, Any], system_prompt: str | None = None) -> list[Message]:
    """Initial messages from ``task["prompt"]`` (str or messages), with an optional system prompt first."""
    prompt = task.get("prompt", task.get("question"))
    if isinstance(prompt, str):
        msgs = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        msgs = [dict(m) for m in prompt]
    else:
        raise ValueError(f"task needs 'prompt' as str or a list of messages; got keys {sorted(task)}")
    if system_prompt and msgs[0].get("role") != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


@register_env("tool")
class ToolEnv(Env):
    """Multi-turn tool use over ``tools``: Tool objects, typed functions, or registered tool names (with
    their arguments as ``{name: {arg: value}}``; see :func:`agentrl.tools.registry.resolve_tools`)."""

    def __init__(
        self,
        tools: Iterable[Tool | Callable[..., Any] | str | dict[str, Any]] = (),
        system_prompt: str | None = None,
        max_turns: int = 8,
        max_calls_per_turn: int = 8,
        max_output_chars: int = 8000,
        verifier: str | None = None,
    ) -> None:
        self.toolset = ToolSet(resolve_tools(tools))
        self.tools = self.toolset.schemas or None
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self.max_output_chars = max_output_chars
        self.parser = HermesParser(max_calls=max_calls_per_turn)
        if verifier is not None:
            self.verifier = verifier
        self.turn = 0

    def fork(self) -> ToolEnv:
        """A copy in the current state (the turn counter); tools, parser and sandbox are shared. The
        sandboxes keep nothing between runs, so there is no sandbox state to copy (agentrl.envs.fork)."""
        return copy.copy(self)

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.turn = 0
        return task_messages(task, self.system_prompt)

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        parsed = self.parser.parse(action_text)
        info: dict[str, Any] = {"turn": self.turn}
        if not parsed.has_calls:
            info["answer"] = parsed.content
            return StepResult(None, terminated=True, info=info)
        if self.turn >= self.max_turns:
            info["reason"] = "max_turns"
            return StepResult(None, truncated=True, info=info)
        ran = await self.toolset.execute_all(parsed.calls)
        results = [ToolResult("parser", f"Error: {e}", True) for e in parsed.errors] + ran
        records = [ToolCallRecord(None, error=e) for e in parsed.errors]
        records += [call_record(c, r) for c, r in zip(parsed.calls, ran, strict=True)]
        info["tool_calls"] = len(parsed.calls)
        info["tool_errors"] = sum(r.is_error for r in results)
        messages: list[Message] = []
        for r in results:
            msg: Message = {
                "role": "tool",
                "content": truncate(r.content, self.max_output_chars),
                "name": r.name,
            }
            if r.call_id:
                msg["tool_call_id"] = r.call_id
            messages.append(msg)
        observation = "\n".join(m["content"] for m in messages)
        return StepResult(
            observation, info=info, observation_role="tool", messages=messages, tool_calls=records
        )


PYTHON_SYSTEM_PROMPT = (
    "You can run Python code with the `python` tool; it returns what the code prints. Use it to compute "
    "and check your work. When you are done, give the final answer inside \\boxed{} without calling a tool."
)


@register_env("python")
class PythonToolEnv(ToolEnv):
    """Code-interpreter tool use: a ``python`` tool running in a sandbox; the answer is scored by
    ``verifier``.

    ``sandbox``: a shared :class:`~agentrl.sandboxes.Sandbox` (one warm pool for all episodes); None takes
    the process-wide shared sandbox of ``backend`` (docker | process | auto). The env never closes a
    sandbox it did not create.
    """

    verifier = "math"

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        backend: str | None = None,
        timeout: float = 10.0,
        system_prompt: str | None = PYTHON_SYSTEM_PROMPT,
        max_turns: int = 6,
        max_output_chars: int = 4000,
        extra_tools: Iterable[Tool | Callable[..., Any] | str | dict[str, Any]] = (),
        verifier: str | None = None,
    ) -> None:
        tool = python_tool(sandbox, timeout, max_output_chars, backend=backend)
        super().__init__(
            [tool, *resolve_tools(extra_tools)], system_prompt, max_turns, max_output_chars=max_output_chars
        )
        if verifier is not None:
            self.verifier = verifier
