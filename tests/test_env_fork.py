"""Forking envs mid-episode (agentrl.envs.fork): each built-in's fork, replay of deterministic envs, the
refusal of envs that can do neither, and the sandbox isolation a forked tool env keeps."""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest
from sandbox_fixtures import BACKENDS, make_backend

from agentrl.envs import Env, MathEnv, PythonToolEnv, SearchEnv, StepResult, ToolEnv
from agentrl.envs.fork import EpisodeLog, ForkError, check_forkable, fork_env, fork_method

pytestmark = pytest.mark.timeout(120)


class CounterEnv(Env):
    """Deterministic, no fork of its own: forked by replay."""

    deterministic = True
    verifier = "exact_match"

    def __init__(self) -> None:
        self.total = 0
        self.closed = False

    async def reset(self, task):
        self.total = int(task.get("start", 0))
        return [{"role": "user", "content": "add numbers"}]

    async def step(self, action_text):
        self.total += int(action_text)
        return StepResult(f"total {self.total}")

    async def close(self):
        self.closed = True


class NoisyEnv(CounterEnv):
    """Claims to be deterministic but is not: a replay must notice."""

    async def step(self, action_text):
        self.total += int(action_text) + random.randint(1, 1000)
        return StepResult(f"total {self.total}")


class PlainEnv(Env):
    async def reset(self, task):
        return [{"role": "user", "content": "hi"}]

    async def step(self, action_text):
        return StepResult(None, terminated=True)


def test_fork_methods_of_the_built_ins_and_the_refusal():
    assert {fork_method(c) for c in (SearchEnv, ToolEnv, PythonToolEnv, MathEnv)} == {"fork"}
    assert fork_method(CounterEnv) == "replay"
    assert fork_method(PlainEnv) is None
    with pytest.raises(ValueError, match=r"env 'plain'.*cannot branch.*deterministic = True"):
        check_forkable(PlainEnv, "plain")


async def test_search_env_fork_keeps_its_counters_and_goes_its_own_way():
    class Retriever:
        async def search(self, query, topk):
            return f"Doc 1(Title: {query}) text"

    env = SearchEnv(retriever=Retriever(), max_turns=3)
    await env.reset({"question": "q"})
    await env.step("<search> a </search>")
    child = await fork_env(env, EpisodeLog({}, []), SearchEnv)
    assert child is not env and (child.turn, child.num_searches) == (1, 1)
    await child.step("<search> b </search>")
    assert (env.turn, env.num_searches, child.turn, child.num_searches) == (1, 1, 2, 2)


async def test_replay_reproduces_the_episode_in_a_fresh_env():
    env = CounterEnv()
    task = {"start": 5}
    log = EpisodeLog(task, await env.reset(dict(task)))
    for action in ("1", "2"):
        log.steps.append((action, await env.step(action)))
    child = await fork_env(env, log, CounterEnv)
    assert child is not env and child.total == env.total == 8
    assert (await child.step("10")).observation == "total 18" and env.total == 8


async def test_replay_that_diverges_is_an_error_and_closes_the_replayed_env():
    made: list[NoisyEnv] = []

    def factory():
        made.append(NoisyEnv())
        return made[-1]

    env = factory()
    log = EpisodeLog({}, await env.reset({}))
    log.steps.append(("1", await env.step("1")))
    with pytest.raises(ForkError, match=r"NoisyEnv replay: step 1 .*deterministic"):
        await fork_env(env, log, factory)
    assert made[-1].closed


async def test_fork_env_refuses_an_env_that_cannot_branch():
    with pytest.raises(ForkError, match="cannot branch"):
        await fork_env(PlainEnv(), EpisodeLog({}, []), PlainEnv)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_forked_python_env_shares_no_writable_dir_and_no_uid_with_its_parent(backend):
    """Parent and fork run at once: neither sees the other's files, and as root each run has its own
    uid (the sandbox's per-run lease), exactly as two unrelated episodes."""
    sb = make_backend(backend, pool_size=2, max_concurrency=2)
    async with sb:
        env = PythonToolEnv(sandbox=sb, timeout=30)
        await env.reset({"prompt": "p"})
        child = await fork_env(env, EpisodeLog({}, []), PythonToolEnv)
        assert child.turn == env.turn and child is not env
        code = (
            "import os, time, pathlib\n"
            "pathlib.Path('mine_{tag}').write_text('x')\n"
            "time.sleep(1.5)\n"
            "print(os.getuid(), sorted(p for p in os.listdir('.') if p.startswith('mine_')))\n"
        )

        def call(tag):
            payload = json.dumps({"name": "python", "arguments": {"code": code.format(tag=tag)}})
            return f"<tool_call>{payload}</tool_call>"

        a, b = await asyncio.gather(env.step(call("parent")), child.step(call("child")))
        out_a, out_b = a.messages[0]["content"], b.messages[0]["content"]
        assert "['mine_parent']" in out_a and "mine_child" not in out_a, out_a
        assert "['mine_child']" in out_b and "mine_parent" not in out_b, out_b
        uid_a, uid_b = out_a.split()[0], out_b.split()[0]
        assert uid_a != "0" and uid_b != "0"
        if backend == "process" and os.geteuid() == 0:  # Docker: each run is in a container of its own
            assert uid_a != uid_b
