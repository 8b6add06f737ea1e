"""A group of Ray actors called as one (agentrl.actor_group), with real actors on a local Ray: spawned on
the placement group bundles asked for; calls to all ranks, rank 0 and each rank with its own arguments
come back in rank order; a rank's error names the rank and keeps its type."""

from __future__ import annotations

import ast
import asyncio
import os
from pathlib import Path

import pytest
import ray

from agentrl.actor_group import ActorGroup, RankError


def _echo() -> type:
    """The worker class, made here: Ray ships it by value (a test module is not importable in its workers)."""

    class Echo:
        """A worker that says who it is, and fails on the ranks told to."""

        def __init__(self, rank: int, failing: tuple[int, ...] = ()) -> None:
            self.rank, self.failing = rank, failing
            self.stopped = False

        def whoami(self, suffix: str = "") -> str:
            return f"{self.rank}{suffix}"

        def env(self, name: str) -> str | None:
            return os.environ.get(name)

        def add(self, a: int, b: int = 0) -> int:
            return self.rank * 100 + a + b

        def fail(self) -> int:
            if self.rank in self.failing:
                raise KeyError(f"nothing on rank {self.rank}")
            return self.rank

        def stop(self) -> bool:
            if self.rank in self.failing:
                raise RuntimeError("stop failed")
            self.stopped = True
            return True

        def is_stopped(self) -> bool:
            return self.stopped

    return Echo


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


async def test_calls_all_rank0_and_each_in_rank_order(ray_local: None) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 0.5}])
    await pg.ready()
    group = ActorGroup.spawn(
        _echo(),
        [(r, (2,)) for r in range(3)],
        placement_group=pg,
        bundle_indices=[2, 0, 1],
        env={"ACTOR_GROUP_TEST": "yes"},
        num_cpus=0.5,
    )
    try:
        assert len(group) == 3
        assert await group.all("whoami", suffix="!") == ["0!", "1!", "2!"]
        free = ray.available_resources()
        assert [free.get(f"CPU_group_{i}_{pg.id.hex()}", 0.0) for i in range(3)] == [0.0] * 3
        assert await group.all("env", "ACTOR_GROUP_TEST") == ["yes"] * 3
        assert await group.rank0("add", 1, b=2) == 3
        assert await group.each("add", [(1,), (2,), (3,)], {"b": 10}) == [11, 112, 213]
        assert group.wait_all("whoami") == ["0", "1", "2"] and group.wait_rank0("whoami") == "0"

        with pytest.raises(KeyError, match=r"(?s)^rank 2: .*nothing on rank 2") as info:
            await group.all("fail")
        assert isinstance(info.value, RankError) and info.value.rank == 2
        with pytest.raises(KeyError, match=r"(?s)^rank 2: .*nothing on rank 2"):
            group.wait_all("fail")
        with pytest.raises(RuntimeError, match=r"(?s)^rank 2: .*stop failed"):
            await group.all_settled("stop")
        assert await group.all("is_stopped") == [True, True, False]  # the others stopped all the same
    finally:
        group.kill()
        remove_placement_group(pg)


async def test_workers_in_process_and_errors_named_by_rank() -> None:
    echo = _echo()
    group = ActorGroup([echo(0), echo(1, failing=(1,))])
    assert await group.all("whoami") == ["0", "1"]
    with pytest.raises(KeyError) as info:
        await group.each("fail", [(), ()])
    assert str(info.value).startswith("rank 1: ") and isinstance(info.value.__cause__, KeyError)

    class Slow:
        def __init__(self, delay: float) -> None:
            self.delay, self.cancelled = delay, False

        async def wait(self) -> None:
            try:
                await asyncio.sleep(self.delay)
            except asyncio.CancelledError:
                self.cancelled = True
                raise
            raise TimeoutError

    slow, fast = Slow(30), Slow(0)
    with pytest.raises(TimeoutError, match=r"^rank 1: TimeoutError$"):
        await ActorGroup([slow, fast]).all("wait")  # the first error ends the call at once
    await asyncio.sleep(0)
    assert slow.cancelled
    with pytest.raises(ValueError, match="bundle_indices needs a placement_group"):
        ActorGroup.spawn(echo, [(0,)], bundle_indices=[0])


def test_the_helper_sits_below_trainer_and_rollout() -> None:
    """The trainer and the rollout both build on it: it imports nothing of agentrl's."""
    source = Path(__file__).resolve().parents[1] / "agentrl" / "actor_group.py"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not {name for name in imported if name.startswith("agentrl")}, imported
