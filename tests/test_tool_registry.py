"""Tools named in a config (the tool registry, ToolEnv's ``tools``), and the tool timeout of sync tools."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from agentrl.envs import make_env
from agentrl.tools import DEFAULT_TIMEOUT, Tool, ToolCall, ToolSet, tool, tool_thread_counts
from agentrl.tools.registry import TOOLS, check_tool_specs, make_tool, register_tool, resolve_tools


def test_built_in_tools_by_name_with_arguments() -> None:
    assert {"python", "search"} <= set(TOOLS.names())
    python = make_tool({"python": {"timeout": 5, "backend": "process"}})
    assert python.name == "python" and python.timeout == 35.0  # the sandbox's 5 s, then a backstop
    search = make_tool({"name": "search", "url": "http://127.0.0.1:1", "topk": 2})
    assert search.name == "search" and search.client.topk == 2
    env = make_env("tool", tools=["python", {"search": {"url": "http://127.0.0.1:1"}}], max_turns=3)
    assert [t["function"]["name"] for t in env.tools] == ["python", "search"]
    env = make_env("python", extra_tools=[{"search": {"url": "http://127.0.0.1:1"}}])
    assert [t["function"]["name"] for t in env.tools] == ["python", "search"]


def test_registered_tools_factories_and_module_paths() -> None:
    @tool
    async def shout(text: str) -> str:
        """Upper-case the text.

        Args:
            text: what to shout
        """
        return text.upper()

    register_tool("test_shout")(shout)

    @register_tool("test_repeat")
    def repeat_tool(times: int = 2) -> Tool:
        async def repeat(text: str) -> str:
            """Repeat the text."""
            return text * times

        return Tool(repeat)

    assert make_tool("test_shout") is shout
    assert make_tool({"test_shout": {"timeout": 2}}).timeout == 2
    assert asyncio.run(make_tool({"test_repeat": {"times": 3}}).invoke({"text": "ab"})).content == "ababab"
    with pytest.raises(TypeError, match=r"tool 'test_shout' is a tool, not a factory"):
        make_tool({"test_shout": {"times": 3}})
    plain = make_tool({"name": "os.path:basename", "timeout": 1})  # a plain typed function, by path
    assert (plain.name, plain.timeout) == ("basename", 1)
    tools = resolve_tools(["test_shout", shout.fn, {"test_repeat": None}])
    assert [t.name for t in tools] == ["shout", "shout", "repeat"]


def test_unknown_tool_names_say_the_nearest() -> None:
    with pytest.raises(
        KeyError, match=r"unknown tool 'pyhton'; did you mean 'python'\? known tools: .*python"
    ):
        make_env("tool", tools=["pyhton"])
    with pytest.raises(ValueError, match=r"^env\.kwargs\.tools\[1\]: unknown tool 'serch'; did you mean"):
        check_tool_specs(["python", {"serch": {"url": "x"}}], "env.kwargs.tools")
    check_tool_specs(["python", {"search": {"url": "x"}}, len], "env.kwargs.tools")  # code objects pass


async def test_a_sync_tool_past_its_timeout_is_an_error_and_its_thread_is_counted() -> None:
    release = threading.Event()

    @tool(timeout=0.2)
    def stuck(seconds: float) -> str:
        """Wait for the test, at most ``seconds``."""
        release.wait(seconds)
        return "late"

    before = tool_thread_counts()
    # a small default executor: abandoned threads must not take its workers
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    t0 = time.monotonic()
    results = await ToolSet([stuck]).execute_all([ToolCall("stuck", {"seconds": 30.0}) for _ in range(3)])
    assert time.monotonic() - t0 < 5
    assert all(r.is_error and "timed out after 0.2s" in r.content for r in results)
    after = tool_thread_counts()
    assert after["abandoned"] - before["abandoned"] == 3
    assert after["abandoned_running"] - before["abandoned_running"] == 3
    assert await asyncio.wait_for(asyncio.to_thread(lambda: 7), 5) == 7  # the loop's pool is free
    release.set()
    for _ in range(100):
        if tool_thread_counts()["abandoned_running"] == before["abandoned_running"]:
            break
        await asyncio.sleep(0.05)
    assert tool_thread_counts()["abandoned_running"] == before["abandoned_running"]


async def test_a_sync_tool_in_time_returns_its_result_and_raises_through() -> None:
    def add(a: int, b: int) -> int:
        return a + b

    def broken() -> str:
        raise RuntimeError("no index")

    tools = ToolSet([add, broken])
    ok, bad = await tools.execute_all([ToolCall("add", {"a": 2, "b": 3}), ToolCall("broken", {})])
    assert (ok.content, ok.is_error) == ("5", False)
    assert bad.is_error and "RuntimeError: no index" in bad.content
    assert Tool(add).timeout == DEFAULT_TIMEOUT == 30.0
