"""pytest-xdist scheduling of the GPU suite over a machine's GPUs (scripts/gpu_test.sh).

Each worker owns GPUs of its own (:func:`agentrl.testing.gpus.suite_phases`: one GPU each for the
one-GPU tests, then as many as the multi-GPU tests need; on one GPU, one worker). A work unit is an
``xdist_group`` (``--dist loadgroup``), or one test; a unit whose tests need N > 1 GPUs carries ``~gpusN``
at the end of its group name (tests/conftest.py names it) and is only handed to a worker with that many.
A worker holding more GPUs than others takes those first, then helps with the rest."""

from __future__ import annotations

import re

import pytest
from xdist.scheduler import LoadGroupScheduling

from agentrl.testing.gpus import gpus_of_worker

_NEED = re.compile(r"~gpus(\d+)$")


def unit_gpus(scope: str) -> int:
    """The GPUs a work unit needs: N for a group named ``...~gpusN``, else 1."""
    m = _NEED.search(scope)
    return int(m.group(1)) if m else 1


class GpuGroupScheduling(LoadGroupScheduling):
    """``loadgroup`` scheduling that hands a unit only to a worker holding the GPUs it needs."""

    def __init__(self, config: pytest.Config, log, layout: list[list[str]]) -> None:
        super().__init__(config, log)
        self.layout = layout

    def _worker_gpus(self, node) -> int:
        return len(gpus_of_worker(node.gateway.id, self.layout))

    def _next_unit(self, node) -> str | None:
        """The unit this worker runs next: the first of those needing the most GPUs it has. A unit needing
        more GPUs than any worker holds (its tests skip) counts as needing as many as the most any holds."""
        have = self._worker_gpus(node)
        most = max((self._worker_gpus(n) for n in self.nodes), default=have)
        fits = [s for s in self.workqueue if min(unit_gpus(s), most) <= have]
        if not fits:
            return None
        return max(fits, key=lambda s: min(unit_gpus(s), most))  # max keeps the first of equals

    def _assign_work_unit(self, node) -> None:
        scope = self._next_unit(node)
        if scope is None:
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(n) for n, done in work_unit.items() if not done])

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if self._next_unit(node) is None:  # what is left needs more GPUs than this worker holds
            if not self._pending_of(self.assigned_work.get(node, {})):
                node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 2:
            return
        self._assign_work_unit(node)
