"""The rollout process's garbage collector: the heap left by imports and setup is frozen once.

A rollout keeps every episode's coroutines, HTTP requests and token lists alive across a turn, so many
of its short-lived objects outlive the young generations and count toward CPython's full collection,
which then runs every second or two and walks every tracked object of the process, most of them the
imported modules' functions, types and dicts (about 600,000 with torch and transformers loaded) that are
never garbage. Each such pass held the event loop for about 0.3 s on 2 vCPU. :func:`freeze_setup_heap`
(``gc.freeze()`` after one full collection) moves what exists at the orchestrator's start out of the
collector's sight: later full collections walk only what the run itself allocated. Nothing the rollout
computes changes; frozen objects that later become cyclic garbage are not reclaimed (the setup's
objects live as long as the process anyway).
"""

from __future__ import annotations

import gc

_frozen = False


def freeze_setup_heap(force: bool = False) -> bool:
    """Collect, then freeze every object tracked now, once per process (``force``: again). True when it
    froze."""
    global _frozen
    if _frozen and not force:
        return False
    gc.collect()
    gc.freeze()
    _frozen = True
    return True
