"""A run's watch over the Ray nodes its parts run on: a node lost mid-run ends the run within seconds, in
one line that names the node and what ran there.

Without it a lost host shows up wherever the run happens to wait: an actor call that fails with a Ray
traceback, or a collective that waits for a peer that is gone until its timeout. :func:`watch_nodes` polls
``ray.nodes()`` while the loop runs; when a node that holds one of the run's parts (:func:`parts_by_node`,
from the placement record ``Fleet.where`` writes) is no longer alive, it cancels the loop and raises
:class:`NodeLost` in its place. An actor's death that surfaces before the poll sees its node go is held
back until Ray says whether a node was lost (:data:`DEATH_GRACE_S`), so both paths end in the same line;
so is any other error while a node of the run does not answer a probe within :data:`PROBE_S` (a call to
a lost engine fails with a connection error before Ray's health checks declare its node dead).
The checkpoints hold what the run trained; ``--resume`` on a replacement node goes on from the last one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

POLL_S = 2.0  # how often the alive nodes are read
DEATH_GRACE_S = 45.0  # how long an actor's death waits for Ray to declare its node dead (health checks)
PROBE_S = 10.0  # how long every node of the run has to run a no-op task after an error


class NodeLost(RuntimeError):
    """A node that ran part of the run is gone; the text names it and the parts."""


def parts_by_node(placed: dict[str, Any]) -> dict[str, tuple[str, list[str]]]:
    """Node id -> (its address, the parts on it: ``driver``, ``engine 0``, ``trainer rank 1``, ``rollout
    shard 0``, ``service retrieval``) from a placement record (``Fleet.where``)."""
    nodes: dict[str, tuple[str, list[str]]] = {}

    def add(at: dict[str, Any], part: str) -> None:
        if at.get("node_id"):
            nodes.setdefault(str(at["node_id"]), (str(at.get("node_ip")), []))[1].append(part)

    add(placed.get("driver", {}), "driver")
    for kind, label in (
        ("engines", "engine"),
        ("trainer_ranks", "trainer rank"),
        ("rollout_shards", "rollout shard"),
    ):
        for i, at in enumerate(placed.get(kind, [])):
            add(at, f"{label} {i}")
    for at in placed.get("services", []):
        add(at, f"service {at.get('name', '?')}")
    return nodes


def lost_nodes(placed: dict[str, Any], nodes: Iterable[dict[str, Any]]) -> str | None:
    """One line naming every node of ``placed`` that ``nodes`` (``ray.nodes()``) no longer has alive and
    what ran there; None when all are alive."""
    alive = {str(n["NodeID"]) for n in nodes if n.get("Alive")}
    gone = [
        f"node {node_id[:8]} ({ip}), which ran {', '.join(parts)}"
        for node_id, (ip, parts) in parts_by_node(placed).items()
        if node_id not in alive
    ]
    if not gone:
        return None
    return f"lost {'; '.join(gone)}: the run stops (resume it with --resume once the node is back)"


def _is_death(err: BaseException) -> bool:
    """An actor or node of Ray that died (how a lost node first shows in an actor call)."""
    import ray.exceptions as rex

    kinds = tuple(
        getattr(rex, name)
        for name in ("RayActorError", "ActorDiedError", "ActorUnavailableError", "NodeDiedError")
        if hasattr(rex, name)
    )
    while err is not None:
        if isinstance(err, kinds):
            return True
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return False


async def _all_answer(placed: dict[str, Any], probe: Callable[[str], Any], timeout: float) -> bool:
    """Whether every node of ``placed`` runs ``probe(node_id)`` within ``timeout`` seconds."""
    try:
        await asyncio.wait_for(asyncio.gather(*[probe(n) for n in parts_by_node(placed)]), timeout)
    except Exception:  # a timeout, or a node Ray no longer schedules on
        return False
    return True


async def _run_noop_on(node_id: str) -> None:
    """A no-op Ray task on the node ``node_id`` (it waits while the node cannot take it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    where = NodeAffinitySchedulingStrategy(node_id, soft=False)
    await ray.remote(_noop).options(num_cpus=0, scheduling_strategy=where).remote()


def _noop() -> None:
    return None


async def _wait_for_loss(
    placed: dict[str, Any], read_nodes: Callable[[], list[dict[str, Any]]], grace: float
) -> str | None:
    deadline = time.monotonic() + grace
    while True:
        message = lost_nodes(placed, await asyncio.to_thread(read_nodes))
        if message is not None or time.monotonic() >= deadline:
            return message
        await asyncio.sleep(POLL_S / 2)


@contextlib.asynccontextmanager
async def watch_nodes(
    placed: dict[str, Any],
    poll: float = POLL_S,
    grace: float = DEATH_GRACE_S,
    read_nodes: Callable[[], list[dict[str, Any]]] | None = None,
    probe: Callable[[str], Any] = _run_noop_on,
    probe_timeout: float = PROBE_S,
) -> AsyncIterator[None]:
    """Run the body while the nodes of ``placed`` are alive; a lost one cancels the body and raises
    :class:`NodeLost`. ``read_nodes``: what lists the nodes (default ``ray.nodes``); ``probe(node_id)``:
    what checks that a node answers after an error (default: a no-op Ray task there)."""
    if read_nodes is None:
        import ray

        read_nodes = ray.nodes
    task = asyncio.current_task()
    assert task is not None
    lost: list[str] = []

    async def poll_nodes() -> None:
        while True:
            await asyncio.sleep(poll)
            message = lost_nodes(placed, await asyncio.to_thread(read_nodes))
            if message is not None:
                lost.append(message)
                task.cancel()
                return

    watcher = asyncio.create_task(poll_nodes())
    try:
        yield
    except BaseException as err:
        watcher.cancel()  # from here on only this block decides: no cancel lands in its own waits
        if lost and task.cancelling():
            task.uncancel()  # the watch's own cancel, turned into the error it stands for
        elif not lost and not isinstance(err, (KeyboardInterrupt, asyncio.CancelledError)):
            if _is_death(err) or not await _all_answer(placed, probe, probe_timeout):
                if (message := await _wait_for_loss(placed, read_nodes, grace)) is not None:
                    lost.append(message)
        if not lost:
            raise
        raise NodeLost(lost[0]) from err
    else:
        watcher.cancel()
        if lost:  # lost as the body ended
            raise NodeLost(lost[0])
