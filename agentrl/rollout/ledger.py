"""The rollout's ledger of draws: where every task the orchestrator drew is.

Each drawn task is accounted for exactly once: **trained** (its group reached the trainer), **dropped**
(by reason; the rollout metrics count the reasons) or **in flight**, which is one of

* *running*: its group's episodes are going (:class:`GroupRun`);
* *buffered*: its group was accepted and waits in the buffer for a batch, or is on its way there;
* *pending*: to be drawn again before the cursor's next task (the tasks in flight at a checkpoint, on
  resume; a group that finished too stale to train, or was refused, re-runs from scratch).

:meth:`DrawLedger.counts` gives ``drawn == trained + dropped + in flight`` as figures;
:meth:`DrawLedger.in_flight` lists the tasks in flight in the order their groups would have reached the
trainer, which is what a checkpoint keeps (:meth:`DrawLedger.state_dict`) so that a resumed run draws
them first, in that order. The orchestrator (:mod:`agentrl.rollout.orchestrator`) moves the draws
between these places; the ledger holds them and the counters.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agentrl.rollout.dataset import DatasetCursor, Draw

TRAINED = "trained"  # the outcome of a draw whose group reached the trainer


@dataclass
class GroupRun:
    """A running group: its draw, the policy version it started under, and its asyncio task."""

    draw: Draw
    start_version: int
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class DrawLedger:
    """The draws of one orchestrator by place, and the counters (see the module docstring).
    ``record_outcomes``: keep each draw's outcome in ``outcomes``, as ``(uid, "trained")`` or
    ``(uid, "dropped:<reason>")``."""

    def __init__(self, cursor: DatasetCursor, record_outcomes: bool = False) -> None:
        self.cursor = cursor
        self.record_outcomes = record_outcomes
        self.pending: deque[Draw] = deque()  # drawn again before the cursor's next
        self.running: dict[str, GroupRun] = {}
        # accepted into the buffer, not yet handed to the trainer (a finished group on its way into the
        # buffer is here and in ``running``: it counts once, as buffered)
        self.buffered: dict[str, Draw] = {}
        self.drawn = 0
        self.trained = 0
        self.trained_uids: set[str] = set()
        self.outcomes: list[tuple[str, str]] = []

    def next_draw(self) -> Draw | None:
        """The next task to start: a pending one first, else the cursor's next (a new draw); None when
        there is none."""
        if self.pending:
            return self.pending.popleft()
        d = self.cursor.next()
        if d is not None:
            self.drawn += 1
        return d

    def has_work(self) -> bool:
        """Whether a task is left to start (pending, or not yet drawn)."""
        return bool(self.pending) or not self.cursor.exhausted

    def dropped(self, uid: str, reason: str) -> None:
        if self.record_outcomes:
            self.outcomes.append((uid, f"dropped:{reason}"))

    def taken(self, uid: str) -> bool:
        """The group of ``uid`` was handed to the trainer. False when it already had been (a duplicate:
        must never happen; the caller says so loudly)."""
        self.buffered.pop(uid, None)
        self.trained += 1
        first = uid not in self.trained_uids
        self.trained_uids.add(uid)
        if self.record_outcomes:
            self.outcomes.append((uid, TRAINED))
        return first

    def counts(self, dropped: int) -> dict[str, int]:
        """drawn, trained, ``dropped`` (the metrics' count, by every reason), the three places in flight,
        and ``balanced``: 1 when drawn == trained + dropped + in flight."""
        running = sum(u not in self.buffered for u in self.running)
        buffered, pending = len(self.buffered), len(self.pending)
        in_flight = running + buffered + pending
        return {
            "drawn": self.drawn,
            "trained": self.trained,
            "dropped": dropped,
            "running": running,
            "buffered": buffered,
            "pending": pending,
            "in_flight": in_flight,
            "balanced": int(self.drawn == self.trained + dropped + in_flight),
        }

    def in_flight(self, queued: list[str], open_batch: list[str]) -> list[Draw]:
        """Every draw in flight, in the order its group would have reached the trainer: taken by a batch
        being formed or on its way into the buffer, ``queued`` in the buffer, the ``open_batch`` of the
        lockstep schedule in draw order, running, pending. A resumed run re-draws them in this order, so
        a deterministic run forms the same batches, in the same order, again."""
        draws = {**{d.uid: d for d in self.pending}, **{u: g.draw for u, g in self.running.items()}}
        draws.update(self.buffered)
        later = set(queued) | set(open_batch)
        ahead = [u for u in self.buffered if u not in later]
        order = [*ahead, *queued, *open_batch, *self.running, *(d.uid for d in self.pending)]
        return [draws[u] for u in dict.fromkeys(order) if u in draws]

    def state_dict(self, queued: list[str], open_batch: list[str]) -> dict[str, Any]:
        """The cursor, every task in flight (in the order of :meth:`in_flight`) and the counters."""
        return {
            "cursor": self.cursor.state_dict(),
            "pending": [
                {"uid": d.uid, "task": d.task, "stale_requeues": d.stale_requeues}
                for d in self.in_flight(queued, open_batch)
            ],
            "drawn": self.drawn,
            "trained": self.trained,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s: the tasks in flight become pending, drawn first."""
        self.cursor.load_state_dict(state["cursor"])
        self.pending = deque(
            Draw(p["uid"], p["task"], int(p.get("stale_requeues", 0))) for p in state.get("pending", [])
        )
        self.running.clear()
        self.buffered.clear()
        self.drawn = int(state.get("drawn", 0))
        self.trained = int(state.get("trained", 0))
