"""Property tests of the staleness invariant (agentrl.buffer) on a simulated async producer/trainer.

Hypothesis drives random interleavings of: admitting groups, groups finishing (accepted or filtered out,
in any order, i.e. stragglers), the trainer taking batches and bumping the version, and checkpoint/resume.
The simulation uses the real StalenessController and TrajectoryBuffer with the orchestrator's rules.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.buffer import Group, StalenessController, TrajectoryBuffer
from agentrl.types import Trajectory

ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "finish", "finish", "drop", "train", "resume"]),
        st.integers(0, 1000),
    ),
    min_size=10,
    max_size=150,
)


def _group(uid: str, version: int) -> Group:
    t = Trajectory(task_id=uid, group_id=uid, prompt_ids=[1])
    t.append_model_tokens([5, 6], [-0.1, -0.2], version)
    return Group(uid, [t], version)


async def _simulate(eta: int, batch: int, extra: int, actions: list[tuple[str, int]]) -> None:
    c = StalenessController(max_staleness=eta, batch_size=batch, extra_running=extra)
    b = TrajectoryBuffer(c)
    running: list[tuple[str, int]] = []  # (uid, version of its first token)
    pending: list[str] = []
    seq = 0
    trained: list[str] = []
    drawn: set[str] = set()
    dropped: list[str] = []
    for kind, r in actions:
        if kind == "admit":
            if c.try_start():
                if pending:
                    uid = pending.pop(0)
                else:
                    uid, seq = f"t{seq}", seq + 1
                drawn.add(uid)
                running.append((uid, c.version))
        elif kind in ("finish", "drop") and running:
            uid, v0 = running.pop(r % len(running))
            if kind == "drop":
                c.finish(accepted=False)  # filtered out: frees capacity
                dropped.append(uid)
            elif not await b.put_group(_group(uid, v0)):
                c.finish(accepted=False)  # rule 2: re-queued, re-run later from scratch
                pending.append(uid)
        elif kind == "train" and len(b) >= batch:
            for g in list(b._queue)[:batch]:  # what the trainer is about to get is fresh enough
                assert c.version - g.min_version <= eta, ("stale group queued", c.version, g.min_version, eta)
            got = await b.get_batch_groups(timeout=1)
            for g in got:  # rule 3 must never be needed: admission + acceptance already hold
                assert c.version - g.min_version <= eta, (c.version, g.min_version, eta)
                trained.append(g.uid)
            c.set_version(c.version + 1)
        elif kind == "resume":
            # checkpoint: everything in flight is re-drawn; the trainer resumes at its version
            pending = [u for u, _ in running] + b.queued_uids() + pending
            await b.drain()
            running = []
            c.on_resume(c.version)
        # invariants after every event
        assert c.capacity() >= 0
        assert b.refused_stale == 0
        assert len(b) <= (eta + 1) * batch + extra
        if not running and len(b) < batch:
            assert c.capacity() > 0, "deadlock: no batch can ever form"
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert not set(trained) & set(dropped)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(eta=st.integers(0, 3), batch=st.integers(1, 4), extra=st.integers(0, 3), actions=ACTIONS)
def test_staleness_bound_and_liveness_hold_for_any_interleaving(
    eta: int, batch: int, extra: int, actions: list[tuple[str, int]]
) -> None:
    asyncio.run(_simulate(eta, batch, extra, actions))


def test_staleness_random_sweep() -> None:
    """The same simulation on 300 seeded random schedules of 120 events (long runs hypothesis rarely
    draws)."""
    rng = random.Random(1234)
    kinds = ["admit", "admit", "finish", "finish", "drop", "train", "resume"]
    for _ in range(300):
        actions = [(rng.choice(kinds), rng.randint(0, 1000)) for _ in range(120)]
        asyncio.run(_simulate(rng.randint(0, 3), rng.randint(1, 4), rng.randint(0, 3), actions))


def test_resume_after_many_versions_does_not_burst() -> None:
    """AReaL #1388 as a scenario: resume at version 40 must admit (eta+1)*B groups, not 41*B."""
    c = StalenessController(max_staleness=1, batch_size=4)
    c.on_resume(40)
    n = 0
    while c.try_start():
        n += 1
    assert n == 8


def test_filtered_stream_never_deadlocks() -> None:
    """AReaL PR #1396 as a scenario: 1000 consecutive filtered groups, then a batch still forms."""

    async def run() -> None:
        c = StalenessController(max_staleness=0, batch_size=2)
        b = TrajectoryBuffer(c)
        for _ in range(1000):
            assert c.try_start()
            c.finish(accepted=False)
        for i in range(2):
            assert c.try_start()
            assert await b.put_group(_group(f"g{i}", 0))
        assert len(await b.get_batch()) == 2

    asyncio.run(run())


@given(st.integers(0, 50), st.one_of(st.none(), st.integers(0, 50)), st.integers(0, 5))
def test_one_staleness_rule_for_controller_trainer_and_orchestrator(
    version: int, min_version: int | None, eta: int
) -> None:
    """The controller, the trainer's assertion and the orchestrator's early restart share one rule."""
    from agentrl.buffer import StalenessError, check_staleness, staleness, within_bound

    ok = within_bound(version, min_version, eta)
    assert ok == (min_version is None or version - min_version <= eta)
    c = StalenessController(max_staleness=eta, batch_size=1, version=version)
    assert c.fresh_enough(min_version) == ok and c.staleness(min_version) == staleness(version, min_version)
    t = Trajectory(task_id="t", group_id="g", prompt_ids=[1, 2])
    if min_version is not None:
        t.append_model_tokens([3], [-0.1], min_version)
    if ok:
        assert check_staleness([t], version, eta) == staleness(version, min_version)
    else:
        with pytest.raises(StalenessError, match=f"> max_staleness {eta}"):
            check_staleness([t], version, eta)
    assert check_staleness([t], version, None) == staleness(version, min_version)  # no bound given
