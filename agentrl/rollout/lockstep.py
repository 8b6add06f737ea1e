"""The rollout's schedule: which batch a draw belongs to, when it may start, how a finished group reaches
the buffer and when a weight update may go ahead. The orchestrator is given one (:class:`RolloutSchedule`)
and asks it at those points; :meth:`agentrl.exactness.Exactness.make_schedule` picks it for a run.

:class:`FreeRunningSchedule` (the default): groups start whenever admission allows and go to the buffer as
they finish; which groups form a batch, and which weights were live while their tokens were sampled,
depend on timing.

:class:`LockstepSchedule`, deterministic mode (the run's ``deterministic`` switch): what reaches the
trainer, and under which policy version, is a function of the step, never of timing. It fixes both
while episodes still run concurrently:

* **Sampling**: every ``/generate`` carries a seed derived from (run seed, draw uid, sample index, turn)
  (:func:`request_seed`); the engine's draws depend on that seed and the position only.
* **Schedule**: batch ``b`` (0-based, trained by the trainer at version ``b``) is generated entirely
  under version ``max(base, b − η)``. Its groups are the first ``B`` that survive filtering among the
  draws made for it, in dataset order: a dropped group (zero variance, failed) is replaced by the next
  draw, and one batch takes draws at a time, so a replacement never races another batch for a task. The
  groups of a batch run concurrently, are held until the batch is complete, and go to the buffer in draw
  order. A weight update waits (it never aborts) until every batch generated under the live version is
  complete, so no episode straddles two versions.

With η ≥ 1 generation still overlaps training: while the trainer trains batch ``v`` (version ``v`` →
``v + 1``), the engines generate batch ``v + η`` under version ``v``. Every trained token is exactly η
versions old once ``b ≥ η``, within the bound of :mod:`agentrl.buffer`.

The engine must also compute each request's logprobs independently of what else it batches: the
embedded engine's batch-invariant kernels, SGLang's deterministic inference (:mod:`agentrl.exactness`).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from typing import Protocol

from agentrl.buffer import Group, TrajectoryBuffer


def seed_hash(*parts: object) -> int:
    """A 63-bit seed hashed from ``parts`` (joined by ``/``): the same parts, the same seed, anywhere."""
    key = "/".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def request_seed(seed: int, uid: str, sample_index: int, turn: int) -> int:
    """The sampling seed of one ``/generate``: a 63-bit hash of (run seed, draw uid, sample, turn)."""
    return seed_hash(seed, uid, sample_index, turn)


class RolloutSchedule(Protocol):
    """What the orchestrator asks its schedule, on its event loop (see the module docstring)."""

    def may_start(self, version: int) -> bool:
        """A draw may start now, under the live policy ``version``."""
        ...

    def start(self, uid: str) -> None:
        """The group of draw ``uid`` started."""
        ...

    async def deliver(self, group: Group, buffer: TrajectoryBuffer) -> bool:
        """The group was kept: put it into ``buffer`` now or hold it for later. False when the buffer
        refused it as too stale (the orchestrator re-runs its task)."""
        ...

    def dropped(self, uid: str) -> None:
        """The group of draw ``uid`` was dropped."""
        ...

    def caught_up(self, version: int) -> bool:
        """A weight update from ``version`` may go ahead."""
        ...

    def open_uids(self) -> list[str]:
        """The draws the schedule holds open, in draw order: what a checkpoint re-draws first."""
        ...

    def resume(self, version: int) -> None:
        """Start again at the trainer's resumed ``version``, the re-drawn tasks first."""
        ...


class FreeRunningSchedule:
    """The default schedule: groups start whenever admission allows and go to the buffer as they finish."""

    def may_start(self, version: int) -> bool:
        return True

    def start(self, uid: str) -> None:
        pass

    async def deliver(self, group: Group, buffer: TrajectoryBuffer) -> bool:
        return await buffer.put_group(group)  # accepted (the buffer told the controller), or too stale

    def dropped(self, uid: str) -> None:
        pass

    def caught_up(self, version: int) -> bool:
        return True

    def open_uids(self) -> list[str]:
        return []

    def resume(self, version: int) -> None:
        pass


class LockstepSchedule:
    """Which batch the next draw belongs to, when it may start, and when a batch goes to the buffer (see
    the module docstring). Owned by the orchestrator, on its event loop."""

    def __init__(self, batch_size: int, max_staleness: int, base_version: int = 0) -> None:
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.resume(base_version)

    def resume(self, version: int) -> None:
        """Batches restart at ``version`` (the trainer's on resume), the re-drawn tasks first."""
        self.base_version = version  # 0, or the trainer's version on resume
        self.batch = version  # the open batch: the one draws go to now
        self._order = itertools.count()  # draw order within the open batch
        self._running: dict[str, int] = {}  # uid -> draw order, of the open batch
        self._done: list[tuple[int, Group]] = []  # its completed, kept groups
        self.release_lock = asyncio.Lock()  # FIFO: batches reach the buffer in batch order

    def version_of(self, batch: int) -> int:
        """The policy version batch ``batch`` is generated under."""
        return max(self.base_version, batch - self.max_staleness)

    def may_start(self, version: int) -> bool:
        """A draw may start now: the open batch's version is live and it still lacks groups."""
        filled = len(self._running) + len(self._done)
        return version >= self.version_of(self.batch) and filled < self.batch_size

    def start(self, uid: str) -> None:
        self._running[uid] = next(self._order)

    def dropped(self, uid: str) -> None:
        """The group of ``uid`` was dropped: the open batch takes another draw in its place."""
        self._running.pop(uid, None)

    def completed(self, group: Group) -> list[Group]:
        """The group was kept. Returns the open batch's groups in draw order once it is complete (the next
        batch opens then), else an empty list (the group is held)."""
        self._done.append((self._running.pop(group.uid), group))
        if len(self._done) < self.batch_size:
            return []
        groups = [g for _, g in sorted(self._done, key=lambda x: x[0])]
        self._done.clear()
        self.batch += 1
        return groups

    async def deliver(self, group: Group, buffer: TrajectoryBuffer) -> bool:
        """The group is held until its batch is complete; a complete batch goes to ``buffer``, whole and in
        draw order. Always True: the schedule keeps every batch within η (a refusal is a bug, raised)."""
        groups = self.completed(group)
        if not groups:
            return True
        async with self.release_lock:
            for grp in groups:
                if not await buffer.put_group(grp):
                    raise RuntimeError(f"deterministic schedule: group {grp.uid} would be trained too stale")
        return True

    def open_uids(self) -> list[str]:
        """The draws of the open batch (running or held), in draw order: what a checkpoint re-draws first."""
        orders = [(o, g.uid) for o, g in self._done] + [(o, u) for u, o in self._running.items()]
        return [u for _, u in sorted(orders)]

    def caught_up(self, version: int) -> bool:
        """Every batch generated under ``version`` is complete (a weight update may go ahead)."""
        return self.version_of(self.batch) > version
