"""The rollout's garbage-collector setting: the setup heap is frozen once, on demand again."""

from __future__ import annotations

import gc

from agentrl.rollout import heap


def test_freeze_setup_heap_freezes_once_per_process() -> None:
    was = heap._frozen
    try:
        heap._frozen = False
        gc.unfreeze()
        kept = [object()]  # something tracked that exists before the freeze
        assert heap.freeze_setup_heap() is True
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert not any(o is kept for o in gc.get_objects())  # out of the collector's generations
        later = [object()]  # made after the freeze: a second call must leave it to the collector
        assert heap.freeze_setup_heap() is False  # once per process
        assert any(o is later for o in gc.get_objects())
        assert (
            gc.get_freeze_count() <= frozen
        )  # nothing frozen again (frozen objects of other threads may die)
        assert heap.freeze_setup_heap(force=True) is True
    finally:
        heap._frozen = was
        gc.unfreeze()
