"""Tools: schemas from type hints and docstrings, validation before the call, errors and timeouts as
observations, truncation, and the built-in search (real loopback HTTP) and python (real sandbox) tools."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel
from tools_fixtures import retrieval_server

from agentrl.sandboxes import ProcessSandbox
from agentrl.tools import (
    RetrievalClient,
    RetrievalError,
    Tool,
    ToolCall,
    ToolSet,
    call_record,
    format_docs,
    parse_docstring,
    python_tool,
    search_tool,
    tool,
    truncate,
)


class Point(BaseModel):
    x: float
    y: float


@tool
async def move(point: Point, mode: Literal["abs", "rel"] = "abs", steps: list[int] | None = None) -> dict:
    """Move a point.

    Longer explanation that is not the summary.

    Args:
        point: where to start
        mode: absolute or relative
            coordinates
        steps (list[int]): step sizes
    """
    return {"x": point.x, "mode": mode, "steps": steps}


def test_schema_from_hints_and_docstring():
    s = move.schema
    assert s["type"] == "function" and s["function"]["name"] == "move"
    assert s["function"]["description"] == "Move a point."
    params = s["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["point"]
    props = params["properties"]
    assert props["mode"] == {
        "default": "abs",
        "description": "absolute or relative coordinates",
        "enum": ["abs", "rel"],
        "type": "string",
    }
    assert props["steps"]["description"] == "step sizes"
    assert "$defs" in params and "Point" in params["$defs"]


def test_sphinx_docstring_and_from_function():
    def f(a: int, b: str = "x") -> str:
        """Join things.

        :param a: a number
        :param str b: a string
        """
        return f"{a}{b}"

    t = Tool.from_function(f, name="join")
    assert t.name == "join" and t.description == "Join things."
    assert t.schema["function"]["parameters"]["properties"]["b"]["description"] == "a string"
    assert parse_docstring(None) == ("", {})


def test_bad_tool_definitions_fail_early():
    def varargs(*a: int) -> None:
        """Nope."""

    with pytest.raises(TypeError, match=r"\*args"):
        Tool.from_function(varargs)
    with pytest.raises(ValueError, match="must match"):
        Tool.from_function(lambda: None, name="bad name!")
    with pytest.raises(ValueError, match="two tools"):
        ToolSet([move, move])


async def test_validation_before_the_call():
    calls = []

    @tool
    async def add(a: int, b: int) -> int:
        """Add."""
        calls.append((a, b))
        return a + b

    assert (await add.invoke({"a": 1, "b": "2"})).content == "3"  # lax coercion of numeric strings
    for bad, msg in [
        ({"a": 1}, "b: Field required"),
        ({"a": "x", "b": 1}, "a: Input should be a valid integer"),
        ({"a": 1, "b": 2, "c": 3}, "c: unexpected argument"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ]:
        r = await add.invoke(bad)
        assert r.is_error and msg in r.content, (bad, r.content)
    assert calls == [(1, 2)]  # the invalid calls never reached the function
    assert await add(a=2, b=3) == 5


async def test_exceptions_and_timeouts_become_error_results():
    @tool(timeout=0.2)
    async def slow() -> str:
        """Sleep."""
        await asyncio.sleep(10)
        return "never"

    @tool
    def boom(x: int) -> int:  # sync: runs in a thread
        """Fail."""
        raise KeyError("nope")

    r = await slow.invoke({})
    assert r.is_error and "timed out after 0.2s" in r.content and r.duration < 2
    r = await boom.invoke({"x": 1})
    assert r.is_error and "KeyError" in r.content and "nope" in r.content


async def test_truncation_with_visible_marker():
    @tool(max_output_chars=1000)
    async def big() -> str:
        """Big."""
        return "A" * 600 + "Z" * 9400

    r = await big.invoke({})
    assert len(r.content) <= 1000 and "characters truncated" in r.content
    assert r.content.startswith("A") and r.content.endswith("Z")
    assert truncate("short", 100) == "short"


async def test_toolset_unknown_tool_and_concurrency():
    @tool
    async def wait(s: float) -> str:
        """Wait s seconds."""
        await asyncio.sleep(s)
        return f"waited {s}"

    ts = ToolSet([wait, move])
    assert [s["function"]["name"] for s in ts.schemas] == ["wait", "move"]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    res = await ts.execute_all(
        [ToolCall("wait", {"s": 0.3}), ToolCall("wait", {"s": 0.3}), ToolCall("nope", {})]
    )
    assert loop.time() - t0 < 0.55  # concurrent
    assert [r.content for r in res[:2]] == ["waited 0.3", "waited 0.3"]
    assert res[2].is_error and "unknown tool 'nope'; available tools: move, wait" in res[2].content


async def test_call_record_is_the_call_as_it_ran():
    ts = ToolSet([move])
    ok, bad = ToolCall("move", {"point": {"x": 1, "y": 2}}, id="c1"), ToolCall("move", {"point": 3})
    r_ok, r_bad = await ts.execute_all([ok, bad])
    rec = call_record(ok, r_ok)
    assert (rec.name, rec.arguments, rec.id, rec.error) == ("move", {"point": {"x": 1, "y": 2}}, "c1", None)
    assert rec.result == '{"x": 1.0, "mode": "abs", "steps": null}' and rec.latency_s == r_ok.duration >= 0
    rec = call_record(bad, r_bad)
    assert (
        rec.result is None
        and rec.error is not None
        and rec.error.startswith("Error: invalid arguments for move")
    )


# ---- search ---------------------------------------------------------------------------------------
async def test_search_tool_speaks_the_retrieval_protocol():
    async with retrieval_server() as srv:
        t = search_tool(srv.url, topk=2)
        r = await t.invoke({"query": "capital of France"})
        assert not r.is_error
        assert srv.requests == [{"queries": ["capital of France"], "topk": 2, "return_scores": True}]
        assert r.content.startswith(
            'Doc 1(Title: "Paris") Paris is the capital and largest city of France.\nDoc 2(Title: '
        )
        assert r.content.count("Doc ") == 2
        await t.client.close()


async def test_retrieval_client_retries_and_reports():
    async with retrieval_server() as srv:
        c = RetrievalClient(srv.url, topk=1, max_retries=1)
        srv.fail_next = 1
        assert (await c.retrieve(["Berlin"]))[0][0]["document"]["id"] == "1"  # retried after one 500
        srv.fail_next = 5
        with pytest.raises(RetrievalError, match="500"):
            await c.retrieve(["Berlin"])
        await c.close()
    dead = search_tool("http://127.0.0.1:9", timeout=2)  # nothing listens on the discard port
    r = await dead.invoke({"query": "x"})
    assert r.is_error and "unreachable" in r.content


def test_format_docs_matches_search_r1():
    docs = [{"document": {"contents": '"T1"\nline a\nline b'}}, {"document": {"contents": "only title"}}]
    assert format_docs(docs) == 'Doc 1(Title: "T1") line a\nline b\nDoc 2(Title: only title) \n'


# ---- python ---------------------------------------------------------------------------------------
async def test_python_tool_runs_in_a_sandbox():
    async with ProcessSandbox() as sb:
        # a generous limit where the code finishes (a busy machine can take seconds to start Python),
        # a short one where it never does
        t, short = python_tool(sb, timeout=60), python_tool(sb, timeout=2)
        assert t.schema["function"]["parameters"]["required"] == ["code"]
        r = await t.invoke({"code": "print(sum(range(10)))"})
        assert (r.content, r.is_error) == ("45", False) or r.content.strip() == "45"
        r = await t.invoke({"code": "1/0"})
        assert "ZeroDivisionError" in r.content and "[exit code 1]" in r.content
        r = await short.invoke({"code": "while True: pass"})
        assert "[killed: timeout" in r.content
        r = await t.invoke({"code": 5})
        assert r.is_error and "code: Input should be a valid string" in r.content
