"""Leaving the weight-sync group is bounded: a teardown that hangs (NCCL waits for its peers) is aborted
after the timeout, and an engine that never answers ``/destroy_weights_update_group`` does not keep the
trainer from leaving. The clean path (both ends leave together over real HTTP, then a new group works) is
in ``test_trainer_engine.py``; the NCCL case on two GPUs in ``test_gpu.py``."""

from __future__ import annotations

import asyncio
import threading
import time

from agentrl.engine import dist as agent_dist
from agentrl.weight_sync.broadcast import WeightBroadcaster


async def test_leave_aborts_a_destroy_that_hangs(monkeypatch) -> None:
    release = threading.Event()
    aborted: list[str] = []

    def hang(pg: str) -> None:  # what an NCCL destroy does while a peer still holds its end
        release.wait(120)

    def abort(pg: str) -> None:
        aborted.append(pg)
        release.set()

    monkeypatch.setattr(agent_dist, "destroy_process_group", hang)
    monkeypatch.setattr(agent_dist, "abort_process_group", abort)
    t0 = time.monotonic()
    assert await agent_dist.leave_process_group("pg", timeout=0.5) is False
    assert aborted == ["pg"]
    assert time.monotonic() - t0 < 10


async def test_leave_is_clean_when_the_destroy_returns(monkeypatch) -> None:
    aborted: list[str] = []
    monkeypatch.setattr(agent_dist, "abort_process_group", aborted.append)
    monkeypatch.setattr(agent_dist, "destroy_process_group", lambda pg: None)
    assert await agent_dist.leave_process_group("pg", timeout=5) is True
    assert aborted == []


class _SilentEngines:
    """Engines that never answer the destroy request (a hung or dead server behind the client)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def destroy_weights_update_group(self, group_name: str) -> None:
        self.asked.append(group_name)
        await asyncio.sleep(3600)


async def test_trainer_leaves_when_the_engine_never_answers() -> None:
    engines = _SilentEngines()
    b = WeightBroadcaster(engines, group_name="teardown_test")
    b.group = await asyncio.to_thread(
        agent_dist.init_custom_process_group,
        "gloo",
        "",
        1,
        0,
        "teardown_test",
        30.0,
        store=agent_dist.host_store(1, 30.0),
    )
    t0 = time.monotonic()
    assert await b.close(timeout=1.0) is False  # the engine did not confirm
    assert time.monotonic() - t0 < 10
    assert engines.asked == ["teardown_test"]
    assert b.group is None
    assert await b.close(timeout=1.0) is True  # closing again is a no-op
