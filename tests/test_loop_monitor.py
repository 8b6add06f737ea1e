"""The event loop monitor: busy fraction and wake-up lag of an idle loop, of a loop blocked on purpose,
by either method (timing the selector, or the loop thread's CPU time), and in the orchestrator's stats."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.rollout.loop_monitor import LoopMonitor

KEYS = {"loop_busy_frac", "loop_cpu_frac", "loop_lag_ms_p50", "loop_lag_ms_p90", "loop_lag_ms_max"}


def sane(snap: dict[str, float]) -> None:
    assert set(snap) == KEYS
    assert 0.0 <= snap["loop_busy_frac"] <= 1.0 and 0.0 <= snap["loop_cpu_frac"] <= 1.0
    assert 0.0 <= snap["loop_lag_ms_p50"] <= snap["loop_lag_ms_p90"] <= snap["loop_lag_ms_max"]


async def blocker(seconds: float, block: float, spin: bool) -> None:
    """Holds the loop for ``block`` s at a time (sleeping in a blocking call, or computing), yielding
    between, for ``seconds`` s."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        if spin:
            while time.perf_counter() - t < block:
                pass
        else:
            time.sleep(block)  # noqa: ASYNC251  (blocking the loop is the point)
        await asyncio.sleep(0)


async def test_idle_and_blocked_loop() -> None:
    mon = LoopMonitor()
    mon.start()
    assert mon.exact  # asyncio's own loop: its selector is timed
    await asyncio.sleep(0.4)
    idle = mon.snapshot()
    sane(idle)
    assert idle["loop_busy_frac"] < 0.3 and idle["loop_lag_ms_p90"] < 20

    await blocker(0.5, 0.03, spin=False)  # a blocking call in a callback: busy, yet no CPU time
    blocked = mon.snapshot()
    sane(blocked)
    assert blocked["loop_busy_frac"] > 0.85
    assert blocked["loop_cpu_frac"] < 0.5 < blocked["loop_busy_frac"]
    assert blocked["loop_lag_ms_p90"] > 15 and blocked["loop_lag_ms_p90"] > idle["loop_lag_ms_p90"] + 10

    await asyncio.sleep(0.3)  # the window was reset: idle again
    again = mon.snapshot(reset_window=False)
    assert again["loop_busy_frac"] < 0.3 and again["loop_lag_ms_p90"] < 20

    selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    assert "select" in selector.__dict__
    mon.stop()
    mon.stop()  # idempotent
    assert "select" not in selector.__dict__ and not mon.running and mon.snapshot() == {}
    await asyncio.sleep(0.02)  # the loop goes on with its own select


async def test_cpu_time_method_sees_computation() -> None:
    mon = LoopMonitor(use_selector=False)
    mon.start()
    assert not mon.exact and "select" not in asyncio.get_running_loop()._selector.__dict__  # type: ignore[attr-defined]
    await asyncio.sleep(0.3)
    idle = mon.snapshot()
    sane(idle)
    assert idle["loop_busy_frac"] == idle["loop_cpu_frac"] < 0.2
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    await blocker(0.5, 0.03, spin=True)
    busy = mon.snapshot()
    got = (time.thread_time() - cpu0) / (time.perf_counter() - wall0)
    sane(busy)
    # the loop thread's share of a core while it spun, whatever a loaded machine gave it: the window's
    # figure is that share, far above the idle window's
    assert busy["loop_busy_frac"] == busy["loop_cpu_frac"] == pytest.approx(got, abs=0.05)
    assert busy["loop_busy_frac"] > idle["loop_busy_frac"] + 0.05
    assert busy["loop_lag_ms_p90"] > 15
    mon.stop()


async def test_two_monitors_on_one_loop_stop_in_any_order() -> None:
    first, second = LoopMonitor(), LoopMonitor()
    first.start()
    second.start()
    first.stop()  # wrapped over by the second: stays in its chain, passing through
    await blocker(0.2, 0.02, spin=False)
    assert second.snapshot()["loop_busy_frac"] > 0.7
    second.stop()
    await asyncio.sleep(0.02)


async def test_orchestrator_reports_its_loop(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from agentrl.engine.client import EngineClient
    from agentrl.engine.types import SamplingParams
    from agentrl.rollout import Orchestrator, RolloutConfig
    from agentrl.testing.envs import SyntheticEnv
    from agentrl.testing.stub_engine import stub_engine_in_process

    tok: Any = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = RolloutConfig(
        group_size=2,
        batch_size=2,
        max_staleness=1,
        max_concurrency=8,
        max_turns=2,
        max_total_tokens=512,
        filter_zero_variance=False,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=8),
    )
    tasks = [{"id": f"t{i}", "prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(8)]
    async with stub_engine_in_process(max_tokens=8) as (_, url):
        client = EngineClient(url)
        orch = Orchestrator(cfg, client, tok, SyntheticEnv, tasks)
        assert not any(k.startswith("rollout/loop_") for k in orch.stats())  # not started: nothing made up
        await orch.start()
        await orch.buffer.get_batch(timeout=30)
        stats = orch.stats()
        await orch.stop()
        await client.close()
    sane({k.removeprefix("rollout/"): v for k, v in stats.items() if k.startswith("rollout/loop_")})
    assert stats["rollout/turns"] > 0


def test_summary_keeps_step_weighted_means_of_loop_and_retrieval_load() -> None:
    from agentrl.metrics import step_time_summary

    history = [
        {
            "step": 1,
            "time/step_s": 1.0,
            "rollout/loop_busy_frac": 0.2,
            "rollout/loop_lag_ms_p90": 2.0,
            "retrieval/busy_frac": 0.1,
        },
        {"step": 2, "time/step_s": 3.0, "rollout/loop_busy_frac": 0.6, "rollout/loop_lag_ms_p90": 10.0},
        {"step": 2, "eval/exact_match": 0.5},  # an evaluation row: no step time, not a step
    ]
    out = step_time_summary(history)
    assert out["rollout_loop_busy_frac"] == (0.2 * 1 + 0.6 * 3) / 4
    assert out["rollout_loop_lag_ms_p90"] == (2.0 * 1 + 10.0 * 3) / 4
    assert out["retrieval_busy_frac"] == 0.1  # over the steps that report it
    assert "rollout_loop_cpu_frac" not in out


def test_without_timings_keeps_what_deterministic_runs_agree_on() -> None:
    """The loop's load, the engines' counters, durations and rates go; the learning figures stay, and so
    does the retrieval servers' worker count (a setting, not a measurement)."""
    from agentrl.metrics import without_timings

    row = {
        "step": 3,
        "loss": 0.5,
        "reward/mean": 0.25,
        "trainer/policy_version": 3,
        "retrieval/workers": 2,
        "time": 12.0,
        "time/step_s": 1.2,
        "train_seconds": 0.4,
        "rollout/trajectories_per_s": 50.0,
        "rollout/engine_idle_frac": 0.1,
        "engine/decode_steps": 80,
        "engine_decode_rows_per_step": 6.0,
        "rollout/loop_busy_frac": 0.3,
        "rollout/shard1/loop_lag_ms_p90": 4.0,
        "retrieval/busy_frac": 0.2,
        "retrieval/latency_ms_p50": 3.0,
    }
    kept = without_timings(row)
    assert kept == {
        "step": 3,
        "loss": 0.5,
        "reward/mean": 0.25,
        "trainer/policy_version": 3,
        "retrieval/workers": 2,
    }


def test_engine_busy_fraction_is_over_the_time_between_reads_and_a_mean_over_engines() -> None:
    """The engines' busy seconds between two reads of their counters, over the wall time between those
    reads (not the steps' own time, which leaves out what ran between a read and the next step's start),
    a mean over the engines that reported them."""
    from agentrl.metrics import step_time_summary

    def row(step: int, busy: float, read_time: float) -> dict[str, float]:
        return {
            "step": step,
            "time/step_s": 0.3,
            "engine/busy_s": busy,
            "engine/read_time": read_time,
            "engine/engines": 2.0,
        }

    out = step_time_summary([row(1, 10.0, 100.0), row(2, 10.6, 100.5)])
    assert out["engine_device_busy_frac"] == pytest.approx(0.6 / 0.5 / 2)
