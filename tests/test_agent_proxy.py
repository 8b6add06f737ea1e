"""Agents as envs: plain openai-SDK agents run by the orchestrator through the recording proxy, against the
embedded engine over loopback HTTP. The recorded trajectories equal, token for token, what the engine was
sent and generated; history the agent edits starts a new trajectory (counted as drift, same reward); a
weight update mid-call gives mixed versions; agent errors fail only their episode; calls after the
episode ended are 410."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from agentrl.embedded.launch import start_embedded_server
from agentrl.engine.client import EngineClient
from agentrl.engine.types import GenerateResult, SamplingParams
from agentrl.envs import AgentEnv, make_env
from agentrl.rollout import Orchestrator, RolloutConfig
from agentrl.rollout.agent_proxy import AgentProxy
from agentrl.types import OBSERVATION_VERSION, Status, Trajectory


class RecordingClient(EngineClient):
    """The engine client, keeping every /generate it made (input ids and the engine's answer)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.calls: list[tuple[list[int], GenerateResult]] = []

    async def generate(self, input_ids, sampling, rid=None, return_logprob=True) -> GenerateResult:
        res = await super().generate(input_ids, sampling, rid, return_logprob)
        self.calls.append((list(input_ids), res))
        return res


async def chatty_agent(task: dict, client: openai.AsyncOpenAI) -> float:
    """Three model calls in one conversation, feedback in between; appends the SDK's own messages."""
    messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
    for turn in range(3):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
        messages.append(r.choices[0].message)
        messages.append({"role": "user", "content": f"feedback {turn}"})
    return float(len(r.choices[0].message.content or "") % 2)


async def editing_agent(task: dict, client: openai.AsyncOpenAI) -> float:
    """Rewrites its own previous answer before the next call: the history no longer extends the tokens.
    The edit goes in front: text appended to a reply cut at max_tokens would still extend its tokens
    exactly, and the proxy rightly continues the same trajectory then."""
    messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
    r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages.append({"role": "assistant", "content": "[edited] " + (r.choices[0].message.content or "")})
    messages.append({"role": "user", "content": "go on"})
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return 0.5


async def long_agent(task: dict, client: openai.AsyncOpenAI) -> float:
    messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
    for _ in range(2):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=200)
        messages += [r.choices[0].message, {"role": "user", "content": "more"}]
    return 1.0


async def two_transports_agent(task: dict, client: openai.AsyncOpenAI) -> float:
    """First call through the given client (in process), streamed; the second over HTTP to the same
    base URL with a client of its own: one conversation either way."""
    messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
    stream = await client.chat.completions.create(
        model="policy", messages=messages, max_tokens=8, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
    async with openai.AsyncOpenAI(base_url=str(client.base_url), api_key="x", max_retries=0) as http:
        await http.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return 1.0


LEAKED: list[openai.AsyncOpenAI] = []


async def leaky_agent(task: dict, client: openai.AsyncOpenAI) -> float | None:
    LEAKED.append(client)
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=4
    )
    if task.get("boom"):
        raise RuntimeError("the agent's own bug")
    return None  # the verifier scores it


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    srv = start_embedded_server(tiny_model_dir, max_batch_size=16)
    yield srv
    srv.stop()


def make_orch(engine: Any, model_dir: Path, agent: Any, **cfg: Any) -> Orchestrator:
    config = RolloutConfig(
        **{
            "group_size": 2,
            "batch_size": 1,
            "max_staleness": 1,
            "max_concurrency": 8,
            "max_turns": 4,
            "max_total_tokens": 600,
            "sampling": SamplingParams(temperature=1.0, max_new_tokens=32),
            "filter_zero_variance": False,
            "shuffle": False,
            **cfg,
        }
    )
    client = RecordingClient(engine.url, timeout=120)
    tasks = [{"prompt": f"task {i}", "label": "1"} for i in range(4)]
    return Orchestrator(
        config, client, AutoTokenizer.from_pretrained(model_dir), lambda: make_env_for(agent), tasks
    )


def make_env_for(agent: Any) -> AgentEnv:
    env = make_env(f"{__name__}:{agent.__name__}")  # the registry wraps an async function
    assert isinstance(env, AgentEnv)
    return env


def assert_token_exact(traj: Trajectory, calls: list[tuple[list[int], GenerateResult]]) -> None:
    """Every assistant turn is one engine answer to exactly the ids before it; the rest is loss_mask 0."""
    traj.validate()
    for turn in traj.turns:
        span = slice(turn.start, turn.end)
        if turn.role == "assistant":
            sent = traj.prompt_ids + traj.response_ids[: turn.start]
            answers = [(r.output_ids, r.logprobs) for ids, r in calls if ids == sent]
            assert (traj.response_ids[span], traj.rollout_logprobs[span]) in answers
            assert set(traj.loss_mask[span]) == {1}
        else:
            assert set(traj.loss_mask[span]) == {0}
            assert set(traj.policy_versions[span]) == {OBSERVATION_VERSION}


async def test_agent_trajectory_equals_engine_tokens(engine, tiny_model_dir):
    orch = make_orch(engine, tiny_model_dir, chatty_agent)
    await orch.start()
    try:
        batch = await asyncio.wait_for(orch.buffer.get_batch(), 120)
    finally:
        await orch.stop()
        await orch.engine.close()
    assert len(batch) == 2 and {t.sample_index for t in batch} == {0, 1}
    for t in batch:
        assert t.status == Status.COMPLETED and t.info["agent_rows"] == 1 and t.num_turns == 3
        assert t.reward in (0.0, 1.0)
        assert_token_exact(t, orch.engine.calls)
        # dumps and the viewer show what each observation said: the agent's messages in between
        shown = [turn.text for turn in t.turns if turn.role == "observation"]
        assert shown == ["feedback 0", "feedback 1"]
    stats = orch.stats()
    assert stats["rollout/turns"] >= 6 and stats.get("rollout/agent_drift_splits", 0) == 0
    assert orch.accounting()["balanced"] == 1


async def test_edited_history_starts_a_new_trajectory(engine, tiny_model_dir):
    orch = make_orch(engine, tiny_model_dir, editing_agent)
    await orch.start()
    try:
        batch = await asyncio.wait_for(orch.buffer.get_batch(), 120)
    finally:
        await orch.stop()
        await orch.engine.close()
    assert len(batch) == 4  # two episodes, two rows each
    for t in batch:
        assert t.info["agent_rows"] == 2 and t.reward == 0.5 and t.num_turns == 1
        assert t.episode_id == f"{t.group_id}/{t.sample_index}"  # GRPO counts the episode once
        assert_token_exact(t, orch.engine.calls)
    assert orch.stats()["rollout/agent_drift_splits"] >= 2  # one per episode (a second group may have run)


async def test_in_process_and_http_calls_record_one_conversation(engine, tiny_model_dir):
    orch = make_orch(engine, tiny_model_dir, two_transports_agent)
    try:
        (t,) = await orch.evaluate([{"prompt": "both ways", "label": "x"}])
    finally:
        await orch.stop()
        await orch.engine.close()
    assert t.status == Status.COMPLETED and t.info["agent_rows"] == 1 and t.num_turns == 2
    assert_token_exact(t, orch.engine.calls)
    assert orch.stats().get("rollout/agent_drift_splits", 0) == 0


async def test_weight_update_mid_call_mixes_versions(engine, tiny_model_dir):
    orch = make_orch(
        engine,
        tiny_model_dir,
        long_agent,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True),
        max_total_tokens=1000,
    )
    await orch.start()
    try:
        # pause only once tokens exist under version 0 (a request in flight may not have decoded yet on a
        # loaded machine, and then every token would come after the update)
        steps = (await orch.engine.server_info())[0]["decode_steps"]
        while (
            orch.m.inflight_requests == 0 or (await orch.engine.server_info())[0]["decode_steps"] < steps + 8
        ):
            await asyncio.sleep(0.005)
        await orch.pause_for_update()
        await orch.engine.update_weights_from_disk(str(tiny_model_dir), weight_version="1")
        await orch.resume_after_update(1)
        # the group that completes first need not hold an interrupted call: read the groups until one does
        batch: list[Trajectory] = []
        versions: set[int] = set()
        for _ in range(4):  # one group a batch, four tasks
            more = await asyncio.wait_for(orch.buffer.get_batch(), 120)
            batch += more
            versions |= {v for t in more for v, m in zip(t.policy_versions, t.loss_mask, strict=True) if m}
            if versions == {0, 1}:
                break
    finally:
        await orch.stop()
        await orch.engine.update_weight_version("default")
        await orch.engine.close()
    assert versions == {0, 1}
    assert orch.stats()["rollout/interrupted_requests"] >= 1
    for t in batch:
        assert_token_exact_across_interrupts(t)


def assert_token_exact_across_interrupts(t: Trajectory) -> None:
    t.validate()
    assert all(
        m == 1 for turn in t.turns if turn.role == "assistant" for m in t.loss_mask[turn.start : turn.end]
    )


async def test_agent_failures_and_ended_sessions(engine, tiny_model_dir):
    LEAKED.clear()
    orch = make_orch(engine, tiny_model_dir, leaky_agent, verifier="exact_match")
    try:
        trajs = await orch.evaluate(
            [{"prompt": "a", "label": "z"}, {"prompt": "b", "label": "z", "boom": True}]
        )
    finally:
        await orch.stop()
        await orch.engine.close()
    ok, boom = trajs
    assert ok.status == Status.COMPLETED and ok.reward == 0.0  # scored by the verifier
    assert boom.status == Status.FAILED and "the agent's own bug" in boom.error
    # a call after its episode ended is a 4xx, never recorded
    orch2 = make_orch(engine, tiny_model_dir, leaky_agent, verifier="exact_match")
    LEAKED.clear()
    try:
        await orch2.evaluate([{"prompt": "a", "label": "z"}])
        with pytest.raises(openai.APIStatusError) as info:
            await LEAKED[0].chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "late"}]
            )
        assert info.value.status_code == 410
        c = openai.AsyncOpenAI(base_url=f"{orch2.agents.proxy.url}/s/nope/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):  # no such episode
            await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        await c.close()
    finally:
        await orch2.stop()
        await orch2.engine.close()


async def test_in_process_transport_answers_like_the_server():
    """Routing and errors of the in-process transport, no engine needed: unknown paths and episodes 404,
    a wrong method 405, an ended episode 410, all in OpenAI's error shape."""
    proxy = AgentProxy(SimpleNamespace(chat=None))  # type: ignore[arg-type]  # no call gets that far
    proxy._ended["old"] = None
    async with httpx.AsyncClient(transport=proxy.transport(), base_url="http://proxy") as c:
        r = await c.post("/s/nope/v1/chat/completions", json={"model": "policy", "messages": []})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_episode"
        assert (await c.get("/s/nope/v1/chat/completions")).status_code == 405
        assert (await c.post("/v1/chat/completions", json={})).status_code == 404
        r = await c.get("/s/old/v1/models")
        assert r.status_code == 410 and r.json()["error"]["code"] == "episode_ended"


def test_the_proxy_records_an_agents_tool_calls_and_their_results() -> None:
    """An agent's reply with OpenAI tool_calls lands on its turn; the tool messages of its next call are
    their results, by tool_call_id (an unknown id, or a second answer, changes nothing)."""
    from agentrl.rollout.agent_proxy import record_tool_calls, record_tool_results
    from agentrl.types import Trajectory

    traj = Trajectory(task_id="t", group_id="g", prompt_ids=[1, 2])
    traj.append_model_tokens([3, 4], [-0.1, -0.2], 0, "<tool_call>...</tool_call>")
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "search", "arguments": '{"query": "Paris"}'},
            },
            {"id": "c2", "type": "function", "function": {"name": "calc", "arguments": "{}"}},
        ],
    }
    record_tool_calls(traj, reply)
    calls = traj.turns[-1].tool_calls
    assert [(c.name, c.arguments, c.id, c.result) for c in calls] == [
        ("search", {"query": "Paris"}, "c1", None),
        ("calc", {}, "c2", None),
    ]
    record_tool_results(
        traj,
        [
            {"role": "user", "content": "go"},
            reply,
            {"role": "tool", "tool_call_id": "c1", "content": "Paris is in France"},
            {"role": "tool", "tool_call_id": "c9", "content": "nobody asked"},
        ],
    )
    record_tool_results(traj, [{"role": "tool", "tool_call_id": "c1", "content": "a second answer"}])
    assert [c.result for c in calls] == ["Paris is in France", None]
    assert Trajectory.from_dict(traj.to_dict()).turns[-1].tool_calls == calls  # dumps keep them
