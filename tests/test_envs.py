"""Envs: registry, the checker's diagnoses, and the built-in envs driven with scripted model outputs
(SearchEnv against a real loopback /retrieve server, PythonToolEnv against a real sandbox)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from tools_fixtures import retrieval_server

from agentrl.envs import (
    Env,
    EnvCheckError,
    MathEnv,
    PythonToolEnv,
    SearchEnv,
    StepResult,
    ToolEnv,
    check_env,
    list_envs,
    make_env,
    register_env,
)
from agentrl.envs.search import INVALID_ACTION, PROMPT
from agentrl.examples.custom_env import GuessEnv
from agentrl.sandboxes import ProcessSandbox
from agentrl.tools import tool


# ---- registry -----------------------------------------------------------------------------------
def test_registry():
    assert {"search", "tool", "python", "math", "guess_number"} <= set(list_envs())
    env = make_env("search", retrieval_url="http://127.0.0.1:1", max_turns=2)
    assert isinstance(env, SearchEnv) and env.max_turns == 2
    assert isinstance(make_env("agentrl.examples.custom_env:GuessEnv"), GuessEnv)
    with pytest.raises(KeyError, match=r"unknown env 'nope'; known envs: .*guess_number.*math.*search"):
        make_env("nope")
    with pytest.raises(TypeError, match="bad config"):
        make_env("math", no_such_option=1)
    with pytest.raises(ValueError, match="already registered"):
        register_env("math")(GuessEnv)


# ---- checker ------------------------------------------------------------------------------------
class SyncStep(Env):
    async def reset(self, task):
        return [{"role": "user", "content": "hi"}]

    def step(self, action_text):  # type: ignore[override]
        return StepResult(terminated=True)


class BadTypes(Env):
    async def reset(self, task):
        return [{"role": "robot", "content": 3}]

    async def step(self, action_text):
        return StepResult(observation=5, reward="1", terminated="yes", observation_format="html")  # type: ignore[arg-type]


class ReturnsDict(Env):
    async def reset(self, task):
        return "hello"

    async def step(self, action_text):
        return {"observation": "x"}


class Blocking(Env):
    async def reset(self, task):
        return [{"role": "user", "content": "q"}]

    async def step(self, action_text):
        time.sleep(0.4)  # noqa: ASYNC251 - the mistake the checker must catch
        return StepResult(terminated=True)


class NeverEnds(Env):
    async def reset(self, task):
        return [{"role": "user", "content": "q"}]

    async def step(self, action_text):
        return StepResult(observation="again")


class Raises(Env):
    async def reset(self, task):
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text):
        return StepResult(terminated=True)

    async def close(self):
        raise RuntimeError("close failed")


class NeedsArgs(Env):
    def __init__(self, url: str) -> None:
        self.url = url

    async def reset(self, task):
        return []

    async def step(self, action_text):
        return StepResult(terminated=True)


class BadCalls(Env):
    async def reset(self, task):
        return [{"role": "user", "content": "q"}]

    async def step(self, action_text):
        return StepResult(terminated=True, tool_calls=[{"name": "search"}])  # type: ignore[list-item]


class Silent(Env):
    async def reset(self, task):
        return [{"role": "user", "content": "q"}]

    async def step(self, action_text):
        return StepResult()


class EmptyObservation(Env):
    """An empty string shows the model nothing, as the rollout sees it: the same problem as none."""

    async def reset(self, task):
        return [{"role": "user", "content": "q"}]

    async def step(self, action_text):
        return StepResult(observation="", messages=[])


class RawMessages(Env):
    async def reset(self, task):
        return [{"role": "user", "content": "q"}]

    async def step(self, action_text):
        msgs = [{"role": "tool", "content": "r"}]
        return StepResult(messages=msgs, observation_format="raw", terminated=True)


@pytest.mark.parametrize(
    "env, expected",
    [
        (SyncStep, ["step() must be `async def`"]),
        (
            BadTypes,
            [
                "message 0 has role 'robot'",
                "message 0 content must be str",
                "observation must be str or None",
                "reward must be a float or None",
                "terminated must be bool",
                "observation_format 'html'",
            ],
        ),
        (
            ReturnsDict,
            ["reset() must return a non-empty list", "must return agentrl.envs.StepResult, got dict"],
        ),
        (Blocking, ["event loop was blocked"]),
        (NeverEnds, ["did not end within 16 steps"]),
        (Raises, ["reset()/step() raised KeyError", "close() raised RuntimeError: close failed"]),
        (NeedsArgs, ["NeedsArgs() raised TypeError", "make every constructor argument optional"]),
        (Silent, ["there is no observation"]),
        (EmptyObservation, ["there is no observation"]),
        (RawMessages, ["observation_format must be 'message', not 'raw'"]),
        (BadCalls, ["tool_calls must be a list of agentrl.types.ToolCallRecord"]),
        (object(), ["does not subclass agentrl.envs.Env", "reset() is missing"]),
    ],
)
async def test_checker_names_each_problem(env, expected):
    problems = await check_env(env, {"label": 1})
    text = "\n".join(problems)
    for e in expected:
        assert e in text, text
    with pytest.raises(EnvCheckError, match="env check failed"):
        await check_env(env, {"label": 1}, raise_on_error=True)


async def test_checker_passes_good_envs():
    assert await check_env(GuessEnv, {"label": 7}, ["<guess>3</guess>", "<guess>7</guess>"]) == []
    assert await check_env(MathEnv(), {"prompt": "1+1?", "label": "2"}) == []
    assert await check_env(SearchEnv(retrieval_url="http://127.0.0.1:9"), {"question": "q"}) == []


# ---- custom env example -----------------------------------------------------------------------------
async def test_custom_env_example_episode():
    env = make_env("guess_number", max_turns=3)
    msgs = await env.reset({"label": 42})
    assert "<guess>N</guess>" in msgs[0]["content"]
    r = await env.step("I think <guess>50</guess>")
    assert (r.observation, r.terminated) == ("lower", False)
    r = await env.step("<guess>10</guess>")
    assert r.observation == "higher"
    r = await env.step("<guess>42")  # stop string trimmed
    assert r.terminated and r.reward == 1.0
    assert _example_lines() <= 60


def _example_lines() -> int:
    return len(
        Path(__import__("agentrl.examples.custom_env", fromlist=["x"]).__file__).read_text().splitlines()
    )


# ---- SearchEnv ----------------------------------------------------------------------------------
def test_search_r1_prompt_is_verbatim():
    assert PROMPT.format(question="Who?") == (
        "Answer the given question. You must conduct reasoning inside <think> and </think> "
        "first every time you get new information. After reasoning, if you find you lack "
        "some knowledge, you can call a search engine by <search> query </search> and it "
        "will return the top searched results between <information> and </information>. You "
        "can search as many times as your want. If you find no further external knowledge "
        "needed, you can directly provide the answer inside <answer> and </answer>, without "
        "detailed illustrations. For example, <answer> Beijing </answer>. Question: Who?\n"
    )
    assert INVALID_ACTION == (
        "\nMy previous action is invalid. If I want to search, I should put the "
        "query between <search> and </search>. If I want to give the final answer, "
        "I should put the answer between <answer> and </answer>. Let me try again.\n"
    )


async def test_search_env_episode_against_a_real_server():
    async with retrieval_server() as srv:
        env = SearchEnv(retrieval_url=srv.url, max_turns=2)
        assert env.stop == ["</search>", "</answer>"] and env.verifier == "exact_match"
        msgs = await env.reset({"question": "What is the capital of France?"})
        assert msgs == [{"role": "user", "content": PROMPT.format(question="What is the capital of France?")}]
        r = await env.step("<think>I need to look it up.</think>\n<search> capital of France </search>")
        assert srv.requests[-1] == {"queries": ["capital of France"], "topk": 3, "return_scores": True}
        assert r.observation_format == "raw" and not r.terminated
        assert r.observation.startswith(
            '\n\n<information>Doc 1(Title: "Paris") Paris is the '
            "capital and largest city of France.\nDoc 2(Title: "
        )
        assert r.observation.endswith("</information>\n\n") and r.observation.count("Doc ") == 3
        [call] = r.tool_calls  # the search as it ran: query, passages, latency
        assert (call.name, call.arguments, call.error) == ("search", {"query": "capital of France"}, None)
        assert call.result is not None and call.result.strip() in r.observation and call.latency_s > 0
        r = await env.step("hmm, no tags")
        assert r.observation == INVALID_ACTION and r.tool_calls == []
        # max_turns=2 turns used: this is the final turn, where a search is no longer run (nor recorded)
        n = len(srv.requests)
        r = await env.step("<search>more</search>")
        assert r.truncated and r.observation is None and len(srv.requests) == n and r.tool_calls == []
    env = SearchEnv(retrieval_url="http://127.0.0.1:9")
    await env.reset({"question": "q"})
    r = await env.step("<answer> Paris </answer>")
    assert r.terminated and r.info["answer"] == "Paris"


def test_search_env_shares_one_client_per_event_loop_and_closes_it_with_the_loop():
    """Episodes on one event loop share one connection pool, closed when the loop shuts down
    (asyncio.run); the next loop gets a new one."""
    import asyncio

    from agentrl.envs import search as search_env

    clients = []

    async def episodes() -> None:
        async with retrieval_server() as srv:
            for _ in range(3):
                env = SearchEnv(retrieval_url=srv.url)
                await env.reset({"question": "q"})
                await env.step("<search> capital of France </search>")
                await env.close()
            pool = search_env._CLIENTS[asyncio.get_running_loop()]
            assert len(pool) == 1 and len(srv.requests) == 3
            clients.append(next(iter(pool.values())))
            assert not clients[-1]._session.closed

    asyncio.run(episodes())
    asyncio.run(episodes())
    assert clients[0] is not clients[1]
    assert all(c._session is None for c in clients)  # closed on their loops' way out


async def test_search_env_variants():
    async with retrieval_server() as srv:
        env = SearchEnv(retrieval_url=srv.url, observation_format="message", topk=1)
        row = {
            "prompt": [{"role": "user", "content": "formatted already"}],
            "reward_model": {"ground_truth": {"target": ["x"]}},
        }
        assert await env.reset(row) == row["prompt"]
        r = await env.step("<search>Berlin")  # engine trimmed the stop string
        assert (r.observation_format, r.observation_role) == ("message", "user")
        assert (
            r.observation
            == '\n\n<information>Doc 1(Title: "Berlin") Berlin is the capital of Germany.</information>\n\n'
        )
        srv.fail_next = 10
        r = await env.step("<search>Rome</search>")  # server down: the model sees it, the episode goes on
        assert "Search failed" in r.observation and "tool_error" in r.info and not r.terminated
        [call] = r.tool_calls
        assert (
            call.result is None and call.error == r.info["tool_error"] and call.arguments == {"query": "Rome"}
        )


# ---- ToolEnv / PythonToolEnv / MathEnv ------------------------------------------------------------
@tool
async def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    return {"a": "alpha"}.get(key, "missing")


async def test_tool_env_round_trip_and_errors():
    env = ToolEnv([lookup], system_prompt="Use tools.", max_turns=3)
    assert env.tools[0]["function"]["name"] == "lookup"
    msgs = await env.reset({"prompt": "What is a?"})
    assert [m["role"] for m in msgs] == ["system", "user"]
    r = await env.step(
        '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": {"k": 1}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{bad</tool_call>'
    )
    assert not r.terminated and r.observation_role == "tool"
    contents = [m["content"] for m in r.messages]
    assert contents[0].startswith("Error: tool call #4: invalid JSON")
    assert contents[1] == "alpha"
    assert "key: Field required" in contents[2] and "k: unexpected argument" in contents[2]
    assert "unknown tool 'nope'; available tools: lookup" in contents[3]
    assert r.info["tool_errors"] == 3 and r.observation == "\n".join(contents)
    # every call as it ran, the malformed one (no name) first, as the messages are ordered
    calls = r.tool_calls
    assert [(c.name, c.arguments) for c in calls] == [
        (None, {}),
        ("lookup", {"key": "a"}),
        ("lookup", {"k": 1}),
        ("nope", {}),
    ]
    assert calls[0].error == contents[0].removeprefix("Error: ") and calls[0].latency_s is None
    assert (calls[1].result, calls[1].error) == ("alpha", None) and calls[1].latency_s >= 0
    assert [c.result for c in calls[2:]] == [None, None] and [c.error for c in calls[2:]] == contents[2:]
    r = await env.step("The answer is alpha.")
    assert r.terminated and r.info["answer"] == "The answer is alpha." and r.tool_calls == []


async def test_tool_env_turn_limit():
    env = ToolEnv([lookup], max_turns=2)
    await env.reset({"prompt": "x"})
    call = '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
    assert not (await env.step(call)).truncated
    assert (await env.step(call)).truncated
    assert await check_env(ToolEnv([lookup]), {"prompt": "x"}, [call, "done"]) == []


async def test_python_tool_env_with_a_real_sandbox():
    async with ProcessSandbox() as sb:
        env = make_env("python", sandbox=sb, timeout=10)  # Python's start takes seconds on a busy machine
        assert isinstance(env, PythonToolEnv) and env.tools[0]["function"]["name"] == "python"
        msgs = await env.reset({"prompt": "What is 2**100 mod 7?", "label": "2"})
        assert msgs[0]["role"] == "system"
        r = await env.step(
            '<tool_call>{"name": "python", "arguments": {"code": "print(2**100 % 7)"}}</tool_call>'
        )
        assert r.observation == "2\n" or r.observation.strip() == "2"
        r = await env.step(
            '<tool_call>{"name": "python", "arguments": {"code": "import time\\ntime.sleep(30)"}}</tool_call>'
        )
        assert "[killed: timeout" in r.observation
        r = await env.step("So the answer is \\boxed{2}.")
        assert r.terminated and env.verifier == "math"


async def test_math_env():
    env = MathEnv()
    msgs = await env.reset({"prompt": "What is 1/2 + 1/4?", "label": "3/4"})
    assert msgs == [
        {
            "role": "user",
            "content": "What is 1/2 + 1/4?\nPlease reason step by step, and put your final answer "
            "within \\boxed{}.",
        }
    ]
    r = await env.step("\\boxed{3/4}")
    assert r.terminated and r.reward is None and env.verifier == "math"


async def test_envs_run_concurrently():
    """Many episodes on one loop: a slow tool in one does not hold up the others."""

    @tool
    async def slow(s: float) -> str:
        """Sleep."""
        await asyncio.sleep(s)
        return "ok"

    async def episode(i: int) -> Any:
        env = ToolEnv([slow])
        await env.reset({"prompt": "x"})
        return await env.step('<tool_call>{"name": "slow", "arguments": {"s": 0.3}}</tool_call>')

    t0 = time.perf_counter()
    rs = await asyncio.gather(*(episode(i) for i in range(50)))
    assert all(r.observation == "ok" for r in rs) and time.perf_counter() - t0 < 2.0
    assert all(0.3 <= r.tool_calls[0].latency_s < 2.0 for r in rs)  # each call's own time
