"""The staleness controller (admission, acceptance, trainer check, resume) and the group buffer."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.buffer import DataExhausted, Group, StalenessController, TrajectoryBuffer
from agentrl.types import Trajectory


def traj(uid: str, version: int, n: int = 3) -> Trajectory:
    t = Trajectory(task_id=uid, group_id=uid, prompt_ids=[1, 2])
    t.append_model_tokens(list(range(5, 5 + n)), [-0.1] * n, version)
    return t


def group(uid: str, version: int, size: int = 2) -> Group:
    return Group(uid, [traj(uid, version) for _ in range(size)], version)


def test_admission_formula() -> None:
    c = StalenessController(max_staleness=1, batch_size=3)
    assert c.bound == (1 + 0 + 1) * 3
    started = 0
    while c.try_start():
        started += 1
    assert started == 6 and c.running == 6 and c.capacity() == 0
    for _ in range(3):
        c.finish(accepted=True)
    assert c.accepted == 3 and c.capacity() == 3 - 3 + 0  # accepted + running = 6 = bound
    c.set_version(1)
    assert c.capacity() == 3  # (1 + 1 + 1) * 3 - 6


def test_dropped_groups_free_capacity_no_deadlock() -> None:
    """AReaL PR #1396: rejected/dropped groups must not stay counted, or admission stalls forever."""
    c = StalenessController(max_staleness=0, batch_size=2)
    for _ in range(100):  # every group gets filtered out (e.g. zero reward variance)
        assert c.try_start()
        c.finish(accepted=False)
    assert c.accepted == 0 and c.running == 0
    assert c.capacity() == 2  # the trainer can still get its first batch


def test_resume_keeps_capacity_bounded() -> None:
    """AReaL #1388: after resume at version v, capacity is (eta+1)*B, not (eta+v+1)*B."""
    for v in (0, 5, 50):
        c = StalenessController(max_staleness=2, batch_size=4)
        c.running = 7  # in flight when the checkpoint was taken: re-drawn, not counted
        c.on_resume(v)
        assert c.version == v
        assert c.capacity() == (2 + 1) * 4


def test_acceptance_targets_the_training_version() -> None:
    c = StalenessController(max_staleness=1, batch_size=2)
    c.set_version(3)
    assert c.target_version(queued=0) == 3 and c.target_version(queued=2) == 4
    assert c.admissible(2, queued=0) and c.admissible(2, queued=1)
    assert not c.admissible(2, queued=2)  # would be trained at 4: 2 versions old
    c.on_batch(2)  # the trainer took a batch at version 3 and is training on it
    assert c.target_version(0) == 4
    assert c.admissible(None, 100)  # no model tokens: nothing can be stale


def test_version_cannot_go_back() -> None:
    c = StalenessController(max_staleness=1, batch_size=1, version=3)
    with pytest.raises(ValueError, match="backwards"):
        c.set_version(2)


async def test_get_batch_whole_groups_fifo() -> None:
    c = StalenessController(max_staleness=1, batch_size=2)
    b = TrajectoryBuffer(c)
    for _ in range(3):
        assert c.try_start()
    for i in range(3):
        assert await b.put_group(group(f"g{i}", 0, size=3))
    assert len(b) == 3 and b.num_trajectories == 9
    taken: list[list[str]] = []
    b.on_taken.append(lambda gs: taken.append([g.uid for g in gs]))
    trajs = await b.get_batch()
    assert [t.group_id for t in trajs] == ["g0"] * 3 + ["g1"] * 3
    assert taken == [["g0", "g1"]] and c.consumed == 2 and c.last_batch_version == 0
    assert b.staleness_hist == {0: 6}


async def test_trainer_side_check_refuses_and_unaccepts() -> None:
    c = StalenessController(max_staleness=1, batch_size=1)
    b = TrajectoryBuffer(c)
    refused: list[str] = []
    b.on_refused.append(lambda g: refused.append(g.uid))
    for uid, v in (("old", 0), ("new", 2)):
        c.try_start()
        b._queue.append(group(uid, v))  # bypass rule 2 to exercise rule 3
        c.finish(accepted=True)
    c.set_version(2)
    accepted_before = c.accepted
    out = await b.get_batch_groups()
    assert [g.uid for g in out] == ["new"]
    assert refused == ["old"] and b.refused_stale == 1
    assert c.accepted == accepted_before - 1  # capacity freed for the re-run


async def test_put_group_refuses_what_would_be_too_stale() -> None:
    c = StalenessController(max_staleness=0, batch_size=1, extra_running=5)
    b = TrajectoryBuffer(c, max_groups=10)
    for _ in range(3):
        c.try_start()
    assert await b.put_group(group("a", 0))
    # behind one queued group it would be trained at version 1 with version-0 tokens: too stale
    assert not await b.put_group(group("b", 0))
    assert c.running == 2  # still running: the orchestrator re-runs it in its slot
    c.set_version(1)
    assert await b.put_group(group("c", 1)) is False  # 'a' still queued: target 1 + 1 = 2 > 1
    with pytest.raises(TimeoutError):  # at version 1, 'a' (version 0) is refused by the trainer check
        await b.get_batch(timeout=0.1)
    assert b.refused_stale == 1 and len(b) == 0


async def test_backpressure_and_timeout_hand_back() -> None:
    c = StalenessController(max_staleness=5, batch_size=2)
    b = TrajectoryBuffer(c, max_groups=1)
    c.try_start()
    c.try_start()
    assert await b.put_group(group("a", 0))
    blocked = asyncio.create_task(b.put_group(group("b", 0)))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # full: backpressure
    with pytest.raises(TimeoutError):
        await b.get_batch(num_groups=3, timeout=0.2)  # only 2 groups will ever be there
    assert await blocked
    assert b.queued_uids() == ["a", "b"]  # what the timed-out call took was handed back, in order
    assert len(await b.get_batch()) == 4


async def test_exhausted_producer_raises() -> None:
    c = StalenessController(max_staleness=1, batch_size=2)
    b = TrajectoryBuffer(c)
    c.try_start()
    assert await b.put_group(group("a", 0))
    await b.set_exhausted()
    with pytest.raises(DataExhausted):
        await b.get_batch()
    assert b.queued_uids() == ["a"]


async def test_groups_taken_by_a_waiting_get_batch_count_for_queue_position() -> None:
    """While the trainer waits for batch v, groups it already took are part of batch v: a group arriving
    behind a full batch's worth lands in batch v+1 and must be judged against v+1."""
    c = StalenessController(max_staleness=0, batch_size=2, extra_running=1)  # over-sampling: 3 may run
    b = TrajectoryBuffer(c)
    for _ in range(3):
        assert c.try_start()
    waiting = asyncio.create_task(b.get_batch_groups())
    await asyncio.sleep(0.01)
    assert await b.put_group(group("x", 0))
    await asyncio.sleep(0.01)  # the waiting get_batch took x
    assert await b.put_group(group("y", 0))  # completes batch 0
    assert not await b.put_group(group("z", 0))  # would be trained at version 1: too stale for eta=0
    assert [g.uid for g in await waiting] == ["x", "y"]
    assert b.refused_stale == 0
