"""A run that cannot progress stops in bounded time with one line naming the cause and the config field to
change (agentrl.rollout.progress): every group zero-variance for a whole pass, every episode failing,
every request refused by the engine (the real embedded engine), the retrieval server down from the start.
The error is a ConfigError (the driver exits with its message) and surfaces from ``get_batch``.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentrl.buffer import Group, NoProgressError, StalenessController, TrajectoryBuffer
from agentrl.cluster import free_port
from agentrl.config import ConfigError
from agentrl.embedded.launch import start_embedded_server
from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.envs.search import SearchEnv
from agentrl.rollout import Orchestrator, RolloutConfig
from agentrl.rollout.progress import ProgressWatch
from agentrl.testing.envs import SyntheticEnv
from agentrl.testing.stub_engine import stub_engine_in_process
from agentrl.types import Status, ToolCallRecord, Trajectory


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def cfg(**kw: Any) -> RolloutConfig:
    base: dict[str, Any] = {
        "group_size": 2,
        "batch_size": 2,
        "max_staleness": 1,
        "max_concurrency": 16,
        "max_turns": 2,
        "max_total_tokens": 512,
        "sampling": SamplingParams(temperature=1.0, max_new_tokens=8),
        "max_retries": 1,
        "engine_retries": 0,
    }
    base.update(kw)
    return RolloutConfig(**base)


def tasks(n: int) -> list[dict[str, Any]]:
    return [
        {"prompt": f"What is {i} + {i}?", "question": f"Who founded city {i}?", "label": "x"}
        for i in range(n)
    ]


async def stopped_run(orch: Orchestrator, bound: float) -> tuple[NoProgressError, float]:
    """Start ``orch`` and ask for a batch as a trainer would; returns the error and the seconds it took."""
    t0 = time.monotonic()
    await orch.start()
    try:
        with pytest.raises(NoProgressError) as info:
            await orch.buffer.get_batch(timeout=bound)
    finally:
        await orch.stop()
    elapsed = time.monotonic() - t0
    err = info.value
    assert isinstance(err, ConfigError)  # the driver exits with the message of a ConfigError
    assert "\n" not in str(err)  # one line
    assert orch.no_progress is err or str(orch.no_progress) == str(err)
    acc = orch.accounting()
    assert acc["balanced"] == 1 and acc["trained"] == 0
    return err, elapsed


async def test_zero_variance_for_a_whole_pass(tok: Any) -> None:
    async with stub_engine_in_process(min_tokens=2, max_tokens=6) as (_, url):
        client = EngineClient(url, timeout=10)
        # reward_p=0: every sample scores 0.0; the dataset cycles forever (epochs None), as in training
        orch = Orchestrator(
            cfg(filter_zero_variance=True),
            client,
            tok,
            lambda: SyntheticEnv(turns=1, reward_p=0.0),
            tasks(12),
        )
        err, elapsed = await stopped_run(orch, bound=60)
        await client.close()
    msg = str(err)
    assert msg.startswith("no progress: the last 12 groups, a whole pass over the 12 tasks, were all dropped")
    assert "zero_variance 12" in msg and "(reward 0.0 in 12 groups)" in msg
    assert "rollout.filter_zero_variance=false" in msg and "rollout.verifier" in msg
    assert orch.m.dropped["zero_variance"] >= 12
    assert elapsed < 30


async def test_every_episode_failing(tok: Any) -> None:
    async with stub_engine_in_process(min_tokens=2, max_tokens=6) as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(cfg(), client, tok, lambda: SyntheticEnv(turns=2, fail_rate=1.0), tasks(100))
        err, elapsed = await stopped_run(orch, bound=60)
        await client.close()
    msg = str(err)
    assert msg.startswith("no progress: the last 32 episodes all failed after their retries (env 32)")
    assert "InjectedEnvError: synthetic env: injected tool failure" in msg
    assert "env.kwargs" in msg and "rollout.no_progress_failures" in msg
    assert orch.m.counters["retries"] >= 32  # each was retried first (max_retries 1)
    assert elapsed < 30


async def test_every_request_refused_by_the_engine(tok: Any, tiny_model_dir: Path) -> None:
    # the engine's context (64 tokens) is smaller than what the rollout asks for: every /generate is a 400
    srv = await asyncio.to_thread(
        start_embedded_server, tiny_model_dir, max_batch_size=8, extra_args=["--context-len", "64"]
    )
    try:
        client = EngineClient(srv.url, timeout=30)
        orch = Orchestrator(
            cfg(sampling=SamplingParams(max_new_tokens=100)),
            client,
            tok,
            lambda: SyntheticEnv(turns=2),
            tasks(100),
        )
        err, elapsed = await stopped_run(orch, bound=60)
        await client.close()
    finally:
        srv.stop()
    msg = str(err)
    assert msg.startswith("no progress: the last 32 episodes all failed after their retries (engine 32)")
    assert "EngineRequestError" in msg and "exceeds the engine's context of 64 tokens" in msg
    assert "the engine refused every request" in msg and "rollout.max_context_length" in msg
    assert elapsed < 30


async def test_retrieval_server_down_from_the_start(tok: Any) -> None:
    # the model searches every turn (scripted engine); nothing listens at the retrieval URL
    search = tok.encode("<search> who founded the city </search>", add_special_tokens=False)
    dead = f"http://127.0.0.1:{free_port()}"
    env = functools.partial(SearchEnv, retrieval_url=dead, max_turns=1, timeout=2.0)
    async with stub_engine_in_process(script=[search]) as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(cfg(verifier="exact_match"), client, tok, env, tasks(100))
        err, elapsed = await stopped_run(orch, bound=60)
        await client.close()
    msg = str(err)
    assert msg.startswith("no progress: the last 32 tool calls all failed and none succeeded (search 32)")
    assert dead in msg and "retrieval_url" in msg
    assert elapsed < 30


async def test_switched_off_it_waits() -> None:
    """no_progress_groups: 0 keeps the old behaviour (the trainer's own timeout decides)."""
    w = ProgressWatch.defaults(batch_size=2, group_size=2, tasks_per_pass=4, groups=0, failures=0)
    t = Trajectory(task_id="t", group_id="g", prompt_ids=[1], status=Status.FAILED, error="env: boom")
    assert all(w.dropped_group("zero_variance", [t]) is None and w.episode(t) is None for _ in range(5000))


def test_a_flaky_but_working_run_never_stops() -> None:
    """10% of episodes failing, 30% of tool calls failing and 90% of groups dropped, over 200,000 of each:
    the defaults never fire; a kept group or a good episode resets the count."""
    rng = random.Random(0)
    w = ProgressWatch.defaults(batch_size=2, group_size=2, tasks_per_pass=None)
    for i in range(200_000):
        failed = rng.random() < 0.1
        t = Trajectory(
            task_id=str(i),
            group_id=str(i),
            prompt_ids=[1],
            status=Status.FAILED if failed else Status.COMPLETED,
            error="env: boom" if failed else None,
            reward=0.0,
        )
        t.append_model_tokens([5], [-0.1], 0)
        t.turns[-1].tool_calls = [ToolCallRecord("search", error="down" if rng.random() < 0.3 else None)]
        assert w.episode(t) is None
        if rng.random() < 0.9:
            assert w.dropped_group("zero_variance", [t]) is None
        else:
            w.kept()
    assert w.max_dropped == 1000 and w.max_failures == 32


async def test_get_batch_hands_out_what_is_queued_then_raises() -> None:
    buf = TrajectoryBuffer(StalenessController(max_staleness=1, batch_size=1))
    assert buf.controller.try_start()
    t = Trajectory(task_id="t", group_id="g0", prompt_ids=[1])
    assert await buf.put_group(Group("g0", [t]))
    waiting = asyncio.ensure_future(buf.get_batch(num_groups=2))  # takes g0, waits for a second group
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await buf.fail(NoProgressError("no progress: test"))
    with pytest.raises(NoProgressError, match="no progress: test"):
        await asyncio.wait_for(waiting, 5)
    assert buf.queued_uids() == ["g0"]  # handed back, not lost
    assert [x.group_id for x in await buf.get_batch()] == ["g0"]
    for _ in range(2):  # and every later call says it again
        with pytest.raises(NoProgressError, match="no progress: test"):
            await asyncio.wait_for(buf.get_batch(), 5)
