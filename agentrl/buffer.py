"""The staleness-bounded trajectory buffer and the ONE owner of the staleness invariant.

Units: a *group* is the ``group_size`` trajectories sampled for one task (GRPO). The trainer consumes
``batch_size`` groups per step and bumps the policy version by one per step. ``B = batch_size`` below
counts groups (the same inequality in trajectories is multiplied by ``group_size`` on both sides).

The invariant (what the trainer relies on)::

    for every trajectory handed to the trainer at policy version v:
        v - min_token_version(trajectory) <= max_staleness  (η)

It is kept by three rules, all in :class:`StalenessController`:

1. Admission (AReaL-style), checked by the orchestrator before it starts a group::

       accepted + running < (η + v + 1) · B        (and a concurrency cap)

   ``accepted`` counts groups accepted for training since version 0 (including those already trained),
   ``running`` the groups in flight. Dropped or refused groups are never counted as accepted and they
   free their ``running`` slot, so filtering can never deadlock admission (AReaL PR #1396). On resume at
   version v, ``accepted := v · B`` and ``running := 0`` (pending work is re-drawn), so capacity stays
   ``(η + 1) · B`` instead of jumping to ``(η + v + 1) · B`` (AReaL #1388 / PR #1345).

2. Acceptance, checked when a group completes: admission bounds the *average* lag, but a straggler that
   started at version s can finish after many faster groups. A completed group is accepted only if the
   version at which it will be trained, ``target = max(v, v_last_batch + 1) + ⌊queued / B⌋`` (FIFO),
   satisfies ``target − min_token_version ≤ η``; otherwise it is not accepted: the orchestrator frees its
   slot and re-queues the task to be re-run from scratch (counted; bounded, then dropped as 'stale').
   Running episodes whose tokens fall more than η behind the current version are restarted early.

3. The trainer-side check in :meth:`TrajectoryBuffer.get_batch`: a group whose oldest model token is
   more than η behind the trainer's version is refused (counted, handed back to the orchestrator to be
   re-run, and un-accepted so its capacity is freed). With rules 1-2 this never fires; it is the assert.

The lag itself is computed in one place, :func:`staleness` / :func:`within_bound`: the controller, the
orchestrator's early restart of a doomed episode and the trainer's assertion
(:func:`check_staleness`, given η by its caller) all call them.

:class:`TrajectoryBuffer` is an asyncio FIFO of whole groups with backpressure (``put_group`` waits
while ``max_groups`` are queued) and ``get_batch()`` that returns whole groups. It lives on one event
loop (the orchestrator's; in training, the Ray actor's). When no batch can ever come, ``get_batch``
raises: :class:`DataExhausted` once the producer finished, :class:`NoProgressError` (with the cause and
the config field to change) once the producer found that it cannot make progress (``fail``).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.config import ConfigError
from agentrl.types import Trajectory


class DataExhausted(RuntimeError):
    """The producer finished (dataset exhausted, nothing in flight) and a full batch can never come."""


class NoProgressError(ConfigError):
    """The run can never form a training batch as configured (every group dropped, every episode or tool
    call failing): the message is one line naming the cause and the config field to change. The producer
    hands it to :meth:`TrajectoryBuffer.fail`; ``get_batch`` raises it."""


class StalenessError(AssertionError):
    """A trajectory older than the staleness bound reached the trainer (should be impossible)."""


def staleness(version: int, min_version: int | None) -> int:
    """How many versions the oldest model token (``min_version``) lags ``version``; 0 with no token."""
    return 0 if min_version is None else version - min_version


def within_bound(version: int, min_version: int | None, max_staleness: int) -> bool:
    """``version - min_version <= η``: tokens this old may still be trained at ``version``."""
    return staleness(version, min_version) <= max_staleness


def check_staleness(trajectories: list[Trajectory], version: int, max_staleness: int | None) -> int:
    """The trainer's assertion of the invariant for a batch trained at ``version``; returns the batch's
    staleness (its oldest token's lag). Raises :class:`StalenessError` past η (``None``: no bound)."""
    versions = [v for t in trajectories if (v := t.min_policy_version) is not None]
    oldest = min(versions) if versions else None
    lag = staleness(version, oldest)
    if max_staleness is not None and not within_bound(version, oldest, max_staleness):
        raise StalenessError(
            f"staleness bound violated: policy_version {version} - min token version {oldest} = {lag} "
            f"> max_staleness {max_staleness}"
        )
    return lag


@dataclass
class Group:
    """One task's group of trajectories as it travels through the buffer."""

    uid: str  # the draw id (unique per task draw; see agentrl.rollout.dataset)
    trajectories: list[Trajectory]
    start_version: int = 0  # policy version when the group was admitted

    @property
    def min_version(self) -> int | None:
        vs = [v for t in self.trajectories if (v := t.min_policy_version) is not None]
        return min(vs) if vs else None


@dataclass
class StalenessController:
    """Owner of the staleness invariant; see the module docstring for the three rules and the formula."""

    max_staleness: int  # η
    batch_size: int  # B, groups consumed per trainer step (= per version bump)
    extra_running: int = 0  # over-sampling: groups that may run beyond the admission bound
    version: int = 0  # v, the trainer's current policy version
    accepted: int = 0  # groups accepted for training, counted from version 0
    running: int = 0  # groups admitted and not finished
    consumed: int = 0  # groups handed to the trainer
    last_batch_version: int | None = None  # version at which the trainer took its last batch
    changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)
    _waiters: list[asyncio.Future[None]] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.batch_size < 1:
            raise ValueError("max_staleness must be >= 0 and batch_size >= 1")

    # ---- rule 1: admission -------------------------------------------------------------------
    @property
    def bound(self) -> int:
        """(η + v + 1) · B"""
        return (self.max_staleness + self.version + 1) * self.batch_size

    def capacity(self) -> int:
        """How many more groups may start now (rule 1, plus the over-sampling allowance)."""
        return max(0, self.bound + self.extra_running - self.accepted - self.running)

    def try_start(self) -> bool:
        """Admit one group if ``accepted + running < (η + v + 1)·B`` (+ extra_running)."""
        if self.capacity() <= 0:
            return False
        self.running += 1
        return True

    def finish(self, accepted: bool) -> None:
        """A running group ended: accepted for training, or dropped (frees its capacity)."""
        if self.running <= 0:
            raise RuntimeError("finish() without a running group")
        self.running -= 1
        if accepted:
            self.accepted += 1
        self.notify()

    # ---- rule 2: acceptance ------------------------------------------------------------------
    def target_version(self, queued: int) -> int:
        """The version at which a group accepted now (behind ``queued`` groups) will be trained."""
        head = (
            self.version
            if self.last_batch_version is None
            else max(self.version, self.last_batch_version + 1)
        )
        return head + queued // self.batch_size

    def admissible(self, min_version: int | None, queued: int) -> bool:
        if min_version is None:  # no model token at all (e.g. failed before sampling): nothing stale
            return True
        return self.target_version(queued) - min_version <= self.max_staleness

    # ---- rule 3: trainer side ----------------------------------------------------------------
    def staleness(self, min_version: int | None) -> int:
        return staleness(self.version, min_version)

    def fresh_enough(self, min_version: int | None) -> bool:
        return within_bound(self.version, min_version, self.max_staleness)

    def on_batch(self, n_groups: int) -> None:
        self.consumed += n_groups
        self.last_batch_version = self.version

    def unaccept(self, n_groups: int = 1) -> None:
        """An accepted group will not be trained after all (refused as stale): free its capacity."""
        self.accepted -= n_groups
        self.notify()

    # ---- version and resume ------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went backwards: {self.version} -> {version}")
        self.version = version
        self.notify()

    def on_resume(self, version: int) -> None:
        """Resume at trainer version ``version`` with an empty buffer and nothing running (AReaL #1388).

        Everything accepted but not trained before the checkpoint is re-drawn by the orchestrator, so
        exactly ``version · B`` groups count as accepted and capacity is ``(η + 1) · B`` again.
        """
        self.version = version
        self.accepted = version * self.batch_size
        self.consumed = version * self.batch_size
        self.running = 0
        self.last_batch_version = None
        self.notify()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "accepted": self.accepted,
            "consumed": self.consumed,
            "max_staleness": self.max_staleness,
            "batch_size": self.batch_size,
        }

    def notify(self) -> None:
        """Wake the admission loop (counters, version, or something it also waits on, changed) and every
        :meth:`wait_until`."""
        self.changed.set()
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checked at every :meth:`notify` (``changed`` belongs to the
        admission loop, which clears it; other waiters use this)."""
        while not predicate():
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut


class TrajectoryBuffer:
    """Async FIFO of whole groups between the orchestrator and the trainer (see module docstring).

    One consumer: the trainer calls ``get_batch`` for one batch at a time (its queue position
    arithmetic, rule 2, assumes batches are formed one after another).

    Public API::

        buffer = TrajectoryBuffer(StalenessController(max_staleness=1, batch_size=32))
        trajs = await buffer.get_batch()            # batch_size whole groups, flattened
        groups = await buffer.get_batch_groups(8)   # as Group objects
    """

    def __init__(self, controller: StalenessController, max_groups: int | None = None) -> None:
        self.controller = controller
        # Default bound: everything admission can ever let through, so backpressure only bites when
        # the caller sets a tighter one.
        self.max_groups = (
            max_groups or (controller.max_staleness + 2) * controller.batch_size + controller.extra_running
        )
        self._queue: deque[Group] = deque()
        self._cond = asyncio.Condition()
        self._exhausted = False
        self._error: NoProgressError | None = None  # the producer cannot make progress (fail)
        self._forming = 0  # groups already taken by a get_batch that is still waiting for the rest
        self.refused_stale = 0
        self.staleness_hist: Counter[int] = Counter()  # per trajectory, at hand-out
        self.batches = 0
        # listeners (the orchestrator): called with the groups handed out / refused
        self.on_taken: list[Callable[[list[Group]], None]] = []
        self.on_refused: list[Callable[[Group], None]] = []

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def num_trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self._queue)

    def queued_uids(self) -> list[str]:
        return [g.uid for g in self._queue]

    async def put_group(self, group: Group) -> bool:
        """Accept a completed group (rule 2). Returns False, accepting nothing, when it would be too
        stale at its training step; the caller re-runs it. Waits while the buffer is full."""
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._queue) < self.max_groups)
            # groups a waiting get_batch already took belong to the batch being formed: count them too
            if not self.controller.admissible(group.min_version, len(self._queue) + self._forming):
                return False  # not accepted; the caller frees its slot (finish) or re-runs it
            self._queue.append(group)
            self.controller.finish(accepted=True)
            self._cond.notify_all()
            return True

    async def get_batch_groups(
        self, num_groups: int | None = None, timeout: float | None = None
    ) -> list[Group]:
        """Wait for ``num_groups`` (default batch_size) groups fresh enough for the trainer's version."""
        n = num_groups or self.controller.batch_size
        out: list[Group] = []

        async def fill() -> None:
            async with self._cond:
                while len(out) < n:
                    await self._cond.wait_for(
                        lambda: bool(self._queue) or self._exhausted or self._error is not None
                    )
                    if not self._queue:
                        if self._error is not None:
                            raise self._error.with_traceback(None)
                        raise DataExhausted(f"producer finished with {len(out)} of {n} groups available")
                    g = self._queue.popleft()
                    self._cond.notify_all()  # room for put_group
                    if not self.controller.fresh_enough(g.min_version):
                        self.refused_stale += 1
                        self.controller.unaccept()
                        for cb in self.on_refused:
                            cb(g)
                        continue
                    out.append(g)
                    self._forming = len(out)

        try:
            await asyncio.wait_for(fill(), timeout)
        except BaseException:
            self._forming = 0
            # hand back what was taken (front of the queue, original order)
            if out:
                async with self._cond:
                    self._queue.extendleft(reversed(out))
                    self._cond.notify_all()
            raise
        self._forming = 0
        for g in out:
            for t in g.trajectories:
                self.staleness_hist[self.controller.staleness(t.min_policy_version)] += 1
        self.controller.on_batch(len(out))
        self.batches += 1
        for cb in self.on_taken:
            cb(out)
        return out

    async def get_batch(
        self, num_groups: int | None = None, timeout: float | None = None
    ) -> list[Trajectory]:
        """``batch_size`` (or ``num_groups``) whole groups, flattened to trajectories, in group order."""
        groups = await self.get_batch_groups(num_groups, timeout)
        return [t for g in groups for t in g.trajectories]

    async def set_exhausted(self, exhausted: bool = True) -> None:
        """The producer says no more groups will come (get_batch then raises DataExhausted when short)."""
        async with self._cond:
            self._exhausted = exhausted
            self._cond.notify_all()

    async def fail(self, error: NoProgressError) -> None:
        """The producer cannot make progress: ``get_batch`` raises ``error`` once the queue cannot serve it
        (groups already queued are still handed out)."""
        async with self._cond:
            self._error = error
            self._cond.notify_all()

    @property
    def error(self) -> NoProgressError | None:
        """What :meth:`fail` was given, or None."""
        return self._error

    def mark_producing(self) -> None:
        """More groups will come after all (a refused group is being re-run)."""
        self._exhausted = False

    async def drain(self) -> list[Group]:
        """Remove and return everything queued (used at shutdown/checkpoint)."""
        async with self._cond:
            groups = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
            return groups

    def stats(self) -> dict[str, float]:
        c = self.controller
        total = sum(self.staleness_hist.values())
        out: dict[str, float] = {
            "buffer/queued_groups": len(self._queue),
            "buffer/queued_trajectories": self.num_trajectories,
            "buffer/refused_stale": self.refused_stale,
            "buffer/batches": self.batches,
            "staleness/version": c.version,
            "staleness/accepted": c.accepted,
            "staleness/running": c.running,
            "staleness/consumed": c.consumed,
            "staleness/capacity": c.capacity(),
            "staleness/mean": (sum(k * v for k, v in self.staleness_hist.items()) / total) if total else 0.0,
            "staleness/max": max(self.staleness_hist) if self.staleness_hist else 0.0,
        }
        for k, v in sorted(self.staleness_hist.items()):
            out[f"staleness/hist_{k}"] = v
        return out
