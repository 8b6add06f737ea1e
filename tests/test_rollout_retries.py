"""The retry policy against the stub engine (a labelled SGLang stand-in) over real HTTP: a failed episode is
re-run with a fresh env up to ``rollout.max_retries`` times; when they run out its group is dropped with the
reason ``failed:<kind>``, counted, logged with the error text and recorded per attempt, never skipped quietly.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentrl.buffer import DataExhausted
from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.envs.base import StepResult
from agentrl.rollout import Orchestrator, RolloutConfig
from agentrl.testing.envs import SyntheticEnv
from agentrl.testing.stub_engine import stub_engine_in_process


class FailsFirstTries(SyntheticEnv):
    """Raises in ``step`` on the first ``fails`` episodes of each (task, sample), counted over the fresh env
    instances the orchestrator makes; ``fails`` comes from the task."""

    seen: Counter[str] = Counter()
    made: list[FailsFirstTries] = []

    def __init__(self) -> None:
        super().__init__(turns=2, reward_p=0.5)
        FailsFirstTries.made.append(self)

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.fails = int(task["fails"])
        self.key = task["prompt"]
        return await super().reset(task)

    async def step(self, action_text: str) -> StepResult:
        if len(self.actions) == 0:
            FailsFirstTries.seen[self.key] += 1
            self.attempt = FailsFirstTries.seen[self.key]
        if self.attempt <= self.fails:
            raise RuntimeError(f"tool exploded on attempt {self.attempt}")
        return await super().step(action_text)


async def _drain(orch: Orchestrator, client: EngineClient) -> int:
    trained = 0
    with pytest.raises(DataExhausted):
        while True:
            trained += len(await orch.buffer.get_batch(timeout=30))
            await orch.pause_for_update()
            await client.update_weight_version(str(orch.version + 1))
            await orch.resume_after_update(orch.version + 1)
    return trained


async def test_retries_use_a_fresh_env_then_drop_the_group_with_its_reason(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    FailsFirstTries.seen.clear()
    FailsFirstTries.made.clear()
    # group_size 1: each task's one episode is its own key. Tasks 0-3 fail once (a retry saves them),
    # tasks 4-5 fail on every attempt (retries run out: the group is dropped)
    tasks = [{"prompt": f"p{i}", "fails": 1 if i < 4 else 99} for i in range(6)]
    cfg = RolloutConfig(
        group_size=1,
        batch_size=1,
        max_staleness=1,
        max_turns=3,
        max_total_tokens=512,
        sampling=SamplingParams(max_new_tokens=8),
        max_retries=2,
        epochs=1,
        shuffle=False,
        record_outcomes=True,
    )
    caplog.set_level(logging.WARNING, logger="agentrl.rollout.orchestrator")
    async with stub_engine_in_process(min_tokens=2, max_tokens=6) as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(cfg, client, tok, FailsFirstTries, tasks)
        await orch.start()
        trained = await _drain(orch, client)
        await orch.stop()
        await client.close()

    assert trained == 4
    # every attempt ran in an env of its own, and each was closed
    assert len(FailsFirstTries.made) == len({id(e) for e in FailsFirstTries.made}) == 4 * 2 + 2 * 3 + 1
    assert all(e.closed for e in FailsFirstTries.made)
    stats = orch.stats()
    assert stats["rollout/retries"] == 4 * 1 + 2 * 2
    assert stats["rollout/dropped_groups/failed:env"] == 2 and stats["rollout/dropped_groups_total"] == 2
    assert stats["rollout/failures/env"] == 4 + 2 * 3
    # every failed attempt is on record with its error text; the outcomes name the reason
    assert len(orch.failed_attempts) == 4 + 2 * 3
    assert all(
        err.startswith("env: RuntimeError: tool exploded on attempt") for *_, err in orch.failed_attempts
    )
    assert sorted(a for uid, _, a, _ in orch.failed_attempts if uid == "0:5") == [0, 1, 2]
    assert sorted(o for _, o in orch.outcomes) == ["dropped:failed:env"] * 2 + ["trained"] * 4
    # the drop was said out loud, with what failed
    drops = [r.getMessage() for r in caplog.records if "dropped (failed:env" in r.getMessage()]
    assert drops and "tool exploded on attempt 3" in drops[0]
    acc = orch.accounting()
    assert acc["drawn"] == 6 and acc["trained"] == 4 and acc["dropped"] == 2 and acc["balanced"] == 1


async def test_no_retries_when_max_retries_is_zero(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    FailsFirstTries.seen.clear()
    FailsFirstTries.made.clear()
    cfg = RolloutConfig(
        group_size=2,
        batch_size=1,
        max_turns=3,
        max_total_tokens=512,
        sampling=SamplingParams(max_new_tokens=8),
        max_retries=0,
        failed_member_policy="drop_member",
        filter_zero_variance=False,  # one member left: its group has one reward
        epochs=1,
        record_outcomes=True,
    )
    # both samples of the task share its key: the first episode to step fails, the other one trains
    async with stub_engine_in_process(min_tokens=2, max_tokens=6) as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(cfg, client, tok, FailsFirstTries, [{"prompt": "p", "fails": 1}])
        await orch.start()
        trained = await _drain(orch, client)
        await orch.stop()
        await client.close()
    assert trained == 1  # drop_member: the group is trained without its failed member
    assert orch.m.counters["retries"] == 0 and orch.m.counters["failed_members_removed"] == 1
    assert len(orch.failed_attempts) == 1 and not orch.m.dropped
