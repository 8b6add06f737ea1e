"""Sleep and wake of the embedded engine: SGLang's ``release_memory_occupation`` and
``resume_memory_occupation``.

A release frees the device memory of some of the engine's tags (``weights``, ``kv_cache``:
:mod:`agentrl.embedded.memory`) while a colocated trainer uses the GPU. The engine sleeps from the start
of a release until every released tag is resumed: requests in flight are taken out keeping their tokens
(as ``pause(retract)``) and wait at the gate (:mod:`agentrl.embedded.gate`) with new ones, then continue
where they were, their KV recomputed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agentrl.embedded.gate import RequestGate
from agentrl.embedded.memory import TAGS, EngineMemory
from agentrl.embedded.runner import ModelRunner
from agentrl.embedded.sampling import EngineBadRequest
from agentrl.embedded.scheduler import Scheduler


class SleepWake:
    """Release and resume of the engine's memory by tag (see the module docstring). ``on_device(fn)`` runs
    ``fn`` on the engine's device thread."""

    def __init__(
        self,
        memory: EngineMemory,
        gate: RequestGate,
        scheduler: Scheduler,
        runner: ModelRunner,
        on_device: Callable[..., asyncio.Future],
    ) -> None:
        self.memory = memory
        self.gate = gate
        self.scheduler = scheduler
        self.runner = runner
        self.on_device = on_device

    async def release(self, tags: list[str] | None = None) -> list[str]:
        """Sleep: free the device memory of ``tags`` (default both); refused for a tag already released.
        Returns the tags released."""
        tags = _checked_tags(tags, list(TAGS))
        already = [t for t in tags if t in self.memory.released]
        if already:
            raise EngineBadRequest(f"{', '.join(already)} already released; resume_memory_occupation first")
        self.gate.sleep()
        self.scheduler.retract_all()
        async with self.gate.drain.write(), self.scheduler.step_lock:  # every request is out; no step runs
            if "kv_cache" in tags:
                self.scheduler.flush_prefix_cache()  # nothing cached survives a released cache
                self.scheduler.drop_slot_copies()
            await self.on_device(lambda: [self.memory.release(t) for t in tags])
        return tags

    async def resume(self, tags: list[str] | None = None) -> list[str]:
        """Wake: give ``tags`` (default: every released one) their memory back; the weights with their
        content, the KV cache empty. Resuming a tag that is not released is refused (a wake without a sleep
        is a caller's bug). Once nothing is released, the engine is awake. Returns the tags resumed."""
        released = [t for t in TAGS if t in self.memory.released]
        if tags is None and not released:
            raise EngineBadRequest("nothing is released: resume_memory_occupation without a release")
        tags = _checked_tags(tags, released)
        resident = [t for t in tags if t not in self.memory.released]
        if resident:
            raise EngineBadRequest(f"{', '.join(resident)} not released: nothing to resume")

        def resume() -> None:
            for t in tags:
                self.memory.resume(t)
            if not self.memory.addresses_stable:
                self.runner.drop_graphs()  # captured over the old addresses; captured again on use

        async with self.scheduler.step_lock:
            await self.on_device(resume)
        if not self.memory.released:
            self.gate.wake()
        return tags

    def state(self) -> dict[str, object]:
        """How the engine frees memory (virtual or copy), what is released now, and each tag's bytes."""
        return {
            "memory_mode": self.memory.mode,
            "asleep": self.gate.sleeping,
            "released": sorted(self.memory.released),
            **{f"{t}_bytes": n for t, n in self.memory.sizes.items()},
            **{f"{k}_s": v for k, v in self.memory.last_seconds.items()},
        }


def _checked_tags(tags: list[str] | None, default: list[str]) -> list[str]:
    """``tags`` checked against the memory tags, each once (``default`` for None)."""
    if tags is None:
        return list(default)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise EngineBadRequest(f"tags must be a list of strings ({', '.join(TAGS)}), not {tags!r}")
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise EngineBadRequest(f"unknown memory tags {bad}; the tags are {', '.join(TAGS)}")
    return list(dict.fromkeys(tags))


__all__ = ["SleepWake"]
