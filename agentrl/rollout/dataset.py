"""A checkpointable cursor over the task dataset.

Every draw gets a unique ``uid`` (``"<epoch>:<index>"``): it names the group through the orchestrator,
the buffer and the accounting (trained / dropped / in flight). The cursor's state is the epoch, the
position within the epoch and the seed: restoring it continues exactly where the checkpoint was taken,
with the same shuffle order.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Draw:
    """One task drawn from the dataset."""

    uid: str
    task: dict[str, Any]
    stale_requeues: int = 0  # times this draw was re-queued because it finished too stale to train

    @property
    def task_id(self) -> str:
        tid = self.task.get("task_id", self.task.get("id"))
        return str(tid) if tid is not None else self.uid


class DatasetCursor:
    """Draws tasks epoch by epoch (optionally shuffled per epoch); ``epochs=None`` cycles forever.

    ``tasks`` is a sequence (random access: shuffling and exact resume) or any iterable (read in order;
    resume re-reads and skips what was drawn).
    """

    def __init__(
        self,
        tasks: Sequence[dict[str, Any]] | Iterable[dict[str, Any]],
        shuffle: bool = False,
        seed: int = 0,
        epochs: int | None = 1,
    ) -> None:
        self._seq: Sequence[dict[str, Any]] | None = tasks if isinstance(tasks, Sequence) else None
        self._iterable = tasks
        self._iter: Iterator[dict[str, Any]] | None = None
        if self._seq is None and shuffle:
            raise ValueError("shuffle needs a sequence of tasks (random access)")
        if self._seq is not None and len(self._seq) == 0:
            raise ValueError("the dataset is empty")
        self.shuffle = shuffle
        self.seed = seed
        self.epochs = epochs
        self.epoch = 0
        self.pos = 0
        self.drawn = 0
        self._order: list[int] | None = None
        self._dead = False

    def _epoch_order(self) -> list[int]:
        assert self._seq is not None
        order = list(range(len(self._seq)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    @property
    def size(self) -> int | None:
        """Tasks per pass (epoch); None for an iterable, whose length is known only at its end."""
        return len(self._seq) if self._seq is not None else None

    @property
    def exhausted(self) -> bool:
        if self._dead:
            return True
        if self.epochs is None or self.epoch < self.epochs - 1:
            return False
        if self.epoch >= self.epochs:
            return True
        if self._seq is not None:
            return self.pos >= len(self._seq)
        return False  # an iterable's end is only known by trying

    def next(self) -> Draw | None:
        """The next task, or None when the dataset is exhausted."""
        while True:
            if self._dead or (self.epochs is not None and self.epoch >= self.epochs):
                return None
            if self._seq is not None:
                if self._order is None:
                    self._order = self._epoch_order()
                if self.pos < len(self._order):
                    idx = self._order[self.pos]
                    self.pos += 1
                    self.drawn += 1
                    return Draw(f"{self.epoch}:{idx}", self._seq[idx])
            else:
                if self._iter is None:
                    self._iter = iter(self._iterable)
                try:
                    task = next(self._iter)
                except StopIteration:
                    task = None
                if task is not None:
                    idx = self.pos
                    self.pos += 1
                    self.drawn += 1
                    return Draw(f"{self.epoch}:{idx}", task)
            # epoch ended
            empty_epoch = self.pos == 0
            self.epoch += 1
            self.pos = 0
            self._order = None
            self._iter = None
            if empty_epoch:  # an empty (or one-shot, already consumed) iterable: stop, never spin
                self._dead = True
                return None

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "pos": self.pos,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drawn": self.drawn,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (
            bool(state.get("shuffle", self.shuffle)) != self.shuffle
            or int(state.get("seed", self.seed)) != self.seed
        ):
            raise ValueError("dataset cursor state was saved with a different shuffle/seed")
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])
        self.drawn = int(state.get("drawn", 0))
        self._order = None
        self._iter = None
        if self._seq is None:  # re-read and skip what this epoch already drew
            self._iter = iter(self._iterable)
            for _ in range(self.pos):
                next(self._iter)
