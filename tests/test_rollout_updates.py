"""The orchestrator against the stub engine over real HTTP on loopback, across weight updates: interrupted
episodes resumed with mixed versions, stale stragglers restarted, checkpoint/resume, evaluation and metrics.
The helpers are test_rollout's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from test_rollout import RecordingClient, cfg, drain_all, run_batches, tasks
from transformers import AutoTokenizer

from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.metrics import MetricsLogger, read_metrics
from agentrl.rollout import ChatTokenizer, Orchestrator, RolloutConfig
from agentrl.testing.envs import SyntheticEnv
from agentrl.testing.stub_engine import stub_engine_in_process


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ---------------------------------------------------------------- weight updates
@pytest.mark.parametrize("mode", ["continue", "restart"])
async def test_interrupted_episodes_resume_with_mixed_versions(tok: Any, mode: str) -> None:
    async with stub_engine_in_process(min_tokens=40, max_tokens=60, per_token_time=0.004) as (_, url):
        client = RecordingClient(url, timeout=10)
        orch = Orchestrator(
            cfg(
                group_size=2,
                batch_size=4,
                max_staleness=2,
                max_turns=1,
                interrupt_mode=mode,
                sampling=SamplingParams(max_new_tokens=64),
            ),
            client,
            tok,
            lambda: SyntheticEnv(turns=1),
            tasks(20),
        )
        await orch.start()
        await asyncio.sleep(0.08)  # mid-generation
        await orch.pause_for_update()
        assert orch.m.inflight_requests == 0
        await client.update_weights_from_disk("/nonexistent/stub", weight_version="1")
        await orch.resume_after_update(1)
        batch = await orch.buffer.get_batch(timeout=30)
        await orch.stop()
        await client.close()
    assert orch.m.counters["interrupted_requests"] > 0
    mixed = [
        t for t in batch if len({v for v, m in zip(t.policy_versions, t.loss_mask, strict=True) if m}) > 1
    ]
    if mode == "continue":
        assert mixed, "an interrupted episode should carry tokens of versions 0 and 1"
        for t in mixed:  # versions never go backwards within an episode
            vs = [v for v, m in zip(t.policy_versions, t.loss_mask, strict=True) if m]
            assert vs == sorted(vs) and t.num_turns == 1
            # the resubmitted request carried the partial response: one turn, contiguous ids
            assert len(t.response_ids) <= 64
    else:
        assert not mixed and orch.m.counters["interrupt_restarts"] > 0


async def test_pause_finds_no_request_running(tok: Any) -> None:
    """The engines are paused only once every interrupted request is back: an engine whose abort-mode
    pause polls (SGLang sleeps a second whenever it still finds a request running) never has to."""
    async with stub_engine_in_process(
        min_tokens=40, max_tokens=60, per_token_time=0.004, pause_poll_interval=0.5
    ) as (engine, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(
            cfg(group_size=2, batch_size=4, max_turns=1, sampling=SamplingParams(max_new_tokens=64)),
            client,
            tok,
            lambda: SyntheticEnv(turns=1),
            tasks(20),
        )
        await orch.start()
        for version in (1, 2, 3):
            await asyncio.sleep(0.08)  # mid-generation
            assert orch.m.inflight_requests > 0
            await orch.pause_for_update()
            assert orch.m.inflight_requests == 0 and engine.paused
            await orch.resume_after_update(version)
        await orch.stop()
        await client.close()
    assert orch.m.counters["interrupted_requests"] > 0
    assert engine.counters["pause_polls"] == 0


async def test_stale_stragglers_restart_not_trained(tok: Any) -> None:
    """eta=0: an episode that started before an update can never be trained; it restarts."""
    async with stub_engine_in_process(min_tokens=30, max_tokens=30, per_token_time=0.005) as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(
            cfg(
                group_size=1,
                batch_size=2,
                max_staleness=0,
                max_turns=1,
                sampling=SamplingParams(max_new_tokens=32),
            ),
            client,
            tok,
            lambda: SyntheticEnv(turns=1),
            tasks(10),
        )
        await orch.start()
        batches = await run_batches(orch, 3, client)
        await orch.stop()
        await client.close()
    for v, batch in enumerate(batches):
        for t in batch:
            assert t.min_policy_version == v  # on-policy: exactly the trainer's version
    assert orch.buffer.refused_stale == 0


# ---------------------------------------------------------------- checkpoint / resume
async def test_checkpoint_resume_redraws_in_flight_exactly_once(tok: Any) -> None:
    ts = tasks(40)
    async with stub_engine_in_process(per_token_time=0.002) as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(
            cfg(group_size=2, batch_size=2, max_staleness=1, shuffle=True, epochs=1),
            client,
            tok,
            lambda: SyntheticEnv(turns=2),
            ts,
        )
        await orch.start()
        first = await run_batches(orch, 3, client)
        state = json.loads(json.dumps(orch.state_dict()))  # serializable
        await orch.stop()
        in_flight = {p["uid"] for p in state["pending"]}
        assert in_flight and state["version"] == 3
        trained_before = {t.group_id for b in first for t in b}

        orch2 = Orchestrator(
            cfg(group_size=2, batch_size=2, max_staleness=1, shuffle=True, epochs=1),
            client,
            tok,
            lambda: SyntheticEnv(turns=2),
            ts,
        )
        orch2.load_state_dict(state, version=3)
        # AReaL #1388: capacity after resume at version 3 is (eta + 1) * B, not (eta + 3 + 1) * B
        assert orch2.controller.capacity() == 2 * 2
        await orch2.start()
        rest = await drain_all(orch2, client)
        await orch2.stop()
        await client.close()
    trained_after = {t.group_id for t in rest}
    assert not trained_before & trained_after  # nothing trained twice
    assert in_flight <= trained_after | {u for u, o in orch2.outcomes if o.startswith("dropped")}
    acc = orch2.accounting()
    assert acc["drawn"] == 40 and acc["balanced"] == 1
    # at the end, groups too few to fill a batch stay buffered (a group dropped on the way leaves one)
    assert acc["in_flight"] == acc["buffered"] < 2
    assert len(trained_before | trained_after) + acc["dropped"] + acc["buffered"] == 40


# ---------------------------------------------------------------- evaluation, metrics, exhaustion
async def test_evaluate_greedy_one_per_task_in_order(tok: Any) -> None:
    async with stub_engine_in_process() as (_, url):
        client = RecordingClient(url, timeout=10)
        orch = Orchestrator(cfg(max_staleness=0), client, tok, lambda: SyntheticEnv(turns=1), tasks(5))
        evals = await orch.evaluate(tasks(7))
        await client.close()
    assert [t.task_id for t in evals] == [f"task{i}" for i in range(7)]
    assert all(sp.temperature == 0.0 for _, sp, _ in client.calls)
    assert orch.accounting()["drawn"] == 0  # evaluation does not touch the training accounting


async def test_metrics_through_logger(tok: Any, tmp_path: Path) -> None:
    async with stub_engine_in_process(per_token_time=0.001) as (_, url):
        client = EngineClient(url, timeout=10)
        logger = MetricsLogger(tmp_path, tensorboard=False)
        orch = Orchestrator(
            cfg(), client, tok, lambda: SyntheticEnv(turns=2, tool_latency=0.01), tasks(10), metrics=logger
        )
        await orch.start()
        await run_batches(orch, 2, client)
        stats = orch.log_metrics(step=2)
        await orch.stop()
        await client.close()
        logger.close()
    row = read_metrics(tmp_path / "metrics.jsonl")[-1]
    for key in (
        "rollout/turns_per_s",
        "rollout/model_tokens_per_s",
        "rollout/episode_len_mean",
        "rollout/episode_turns_mean",
        "rollout/tool_latency_mean_s",
        "rollout/engine_idle_frac",
        "buffer/queued_groups",
        "staleness/mean",
        "staleness/hist_0",
        "rollout/dropped_groups_total",
        "rollout/failures_total",
    ):
        assert key in row, key
    assert stats["rollout/tool_latency_mean_s"] >= 0.009
    assert 0.0 <= stats["rollout/engine_idle_frac"] <= 1.0


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        RolloutConfig(group_size=8, max_concurrency=4)
    with pytest.raises(ValueError):
        RolloutConfig(max_staleness=-1)


def test_observation_fast_paths_equal_the_template_delta(tok: Any) -> None:
    """The split encoding (only the text between added tokens) equals encoding the whole template delta,
    for random content full of whitespace, unicode and special-token strings."""
    import random

    chat = ChatTokenizer(tok)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(0)
    alphabet = [*'ab \n\t<>/{}"xyzü中', "<tool_call>", "</tool_response>", "<|im_end|>", "<|im_start|>"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        for role in ("tool", "user"):
            slow = chat.encode(chat._slow_delta(role, text))
            assert chat.observation_ids(text, last_token_id=None, role=role) == slow
            assert chat.observation_ids(text, last_token_id=eot, role=role) == slow[1:]
    assert chat._split_cache.get("tool") is not None  # the fast path is actually in use for this template
