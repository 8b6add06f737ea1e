"""The step's two hand-overs between the engines and the trainer, and how colocated ones share a GPU.

The loop calls :class:`Handover` at two points of every step: :meth:`Handover.to_trainer` once the batch
is in, and :meth:`Handover.to_engines` once the trainer has stepped, which pauses generation, pushes the
new weights (policy version + 1) and gives the GPU back to the engines. What happens at each point
follows ``placement`` and ``colocation`` (agentrl.run_config):

* disaggregated, or colocated with ``mode: overlap``: the engines generate beside the step; they pause for
  the weight sync only.
* colocated with ``mode: turns`` (slime's order): generation pauses for the whole step. Before it the
  engines release their memory (``engine_release``: SGLang's ``/release_memory_occupation``) while the
  trainer takes its state back from host memory (``trainer_offload``); after it the engines take their
  weights back and get the new ones, then their KV cache, while the trainer moves its state off the GPU
  again. That move overlaps the next generation; the next step (or a checkpoint) waits for it. With
  ``trainer_offload: ahead`` the onload starts while the batch's last episodes still generate
  (:class:`OnloadAhead`).

The trainer's state beside awake engines is how a colocated run starts (the engines size their cache
first, then the trainer is built on the GPU), so the onload and the offload fit beside them; the step's
activations come only after the engines released their memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any

from agentrl.run_config import RunConfig
from agentrl.weight_sync import sync_phases

if TYPE_CHECKING:
    from agentrl.engine.client import EngineClient
    from agentrl.rollout.shards import RolloutGroup
    from agentrl.trainer.ray_actor import TrainerGroup

# the tags the loop resumes again (weights, then the KV cache); never None, which SGLang reads as its
# cuda_graph tag too, that nothing would resume
RELEASE_TAGS: dict[str, list[str] | None] = {"all": ["kv_cache", "weights"], "kv_cache": ["kv_cache"]}


async def _seconds(call: Awaitable[Any]) -> float:
    t0 = time.monotonic()
    await call
    return time.monotonic() - t0


class Handover:
    """Where the GPU goes at the step's two hand-overs (see the module docstring). ``control`` talks to
    every engine (release and resume). ``phases`` holds the last step's ``time/*`` figures of what
    happened at the hand-overs."""

    def __init__(
        self, cfg: RunConfig, trainer: TrainerGroup, rollout: RolloutGroup, control: EngineClient
    ) -> None:
        colocation = cfg.colocation
        self.turns = cfg.placement == "colocated" and colocation.mode == "turns"
        self.release = colocation.engine_release if self.turns else "none"
        self.offload = self.turns and colocation.trainer_offload != "none"
        self.ahead = OnloadAhead(self.turns and colocation.trainer_offload == "ahead")
        self.trainer, self.rollout, self.control = trainer, rollout, control
        self.phases: dict[str, float] = {}
        self._offloading: asyncio.Future[float] | None = None  # the trainer's offload, under way
        self._onloading: asyncio.Future[float] | None = None  # its onload, started ahead of the batch
        self._offload_alloc_s = 0.0  # of the last offload, seconds making new host buffers
        self._wait_from = time.monotonic()

    async def start(self) -> None:
        """Before the first step: the engines generate first, so the trainer's state waits off the GPU."""
        if self.offload:
            await self.trainer.offload()

    def batch_coming(self) -> None:
        """The loop starts waiting for a batch: a new step's figures, and the onload ahead of the batch."""
        self.phases = {}
        self._wait_from = time.monotonic()
        self._onloading = self.ahead.start(self.trainer, self._offloading)

    async def to_trainer(self) -> None:
        """The batch is in. Taking turns: generation pauses, the engines release their memory while the
        trainer takes its state back (or finishes taking it back, when the onload started ahead)."""
        wait = time.monotonic() - self._wait_from
        self.ahead.now()
        if not self.turns:
            return
        await self.rollout.pause_for_update()
        if self._offloading is not None:  # the last step's offload, overlapped with generation
            t0 = time.monotonic()
            self.phases["time/trainer_offload_s"] = await self._offloading
            self.phases["time/trainer_offload_wait_s"] = time.monotonic() - t0
            self.phases["time/trainer_offload_host_alloc_s"] = self._offload_alloc_s
        moves = []
        if self.release != "none":
            release = self.control.release_memory_occupation(RELEASE_TAGS[self.release])
            moves.append(self._timed("engine_release", release))
        if self._onloading is not None:  # under way since before the batch came: what is left of it
            moves.append(self._rest_of_onload(self._onloading))
        elif self.offload:
            moves.append(self._timed("trainer_onload", self.trainer.onload()))
        t0 = time.monotonic()
        await asyncio.gather(*moves)
        if moves:
            self.phases["time/to_trainer_s"] = time.monotonic() - t0  # both, overlapped
        self._offloading = self._onloading = None
        self.ahead.observe(wait, self.phases)

    async def to_engines(self) -> int:
        """The trainer stepped: generation pauses (it already has when taking turns), the engines get the
        new weights; taking turns, they take their memory back while the trainer's state moves off the GPU.
        Returns the new policy version; the rollout resumes under it once the loop read its figures."""
        if not self.turns:  # generation went on beside the step; it pauses for the weight sync only
            await self.rollout.pause_for_update()
        t0 = time.monotonic()
        if self.release == "all":
            await self._timed("engine_resume_weights", self.control.resume_memory_occupation(["weights"]))
        version = await self._timed("weight_sync", self.trainer.sync_weights())
        # asked now: a trainer rank answers one call at a time, so once the offload below is under way
        # the question would wait for it, and the rollout's resume with it
        parts = await self._sync_parts()
        if self.offload:
            await self.trainer.release_cached_memory()
            self._offloading = asyncio.ensure_future(self._offload())
        if self.release != "none":
            await self._timed("engine_resume_kv", self.control.resume_memory_occupation(["kv_cache"]))
        self.phases["time/sync_s"] = time.monotonic() - t0
        self.phases.update(parts)
        return version

    @contextlib.asynccontextmanager
    async def trainer_resident(self) -> AsyncIterator[None]:
        """The trainer's state on its device for the block (a checkpoint): an offload under way ends first,
        and offloaded state comes back for the block and leaves again after it."""
        if self._offloading is not None:
            offloading, self._offloading = self._offloading, None
            await offloading
        if self.offload:
            await self.trainer.onload()
        yield
        if self.offload:
            await self.trainer.offload()

    async def close(self) -> None:
        """On the way out: an offload or onload under way ends (bounded); its error is printed, so as not
        to hide the one being raised."""
        for fut in (self._offloading, self._onloading):
            if fut is None:
                continue
            try:
                await asyncio.wait_for(fut, 300)
            except Exception as err:
                print(f"trainer offload or onload failed: {err}", file=sys.stderr)
        self._offloading = self._onloading = None

    async def _offload(self) -> float:
        """The trainer's offload; its seconds, and in ``phases`` those spent making host buffers."""
        t0 = time.monotonic()
        figures = await self.trainer.offload()
        self._offload_alloc_s = float(figures.get("offload_host_alloc_s", 0.0))
        return time.monotonic() - t0

    async def _timed(self, key: str, call: Awaitable[Any]) -> Any:
        t0 = time.monotonic()
        result = await call
        self.phases[f"time/{key}_s"] = time.monotonic() - t0
        return result

    async def _rest_of_onload(self, onloading: asyncio.Future[float]) -> None:
        t0 = time.monotonic()
        self.phases["time/trainer_onload_s"] = await onloading
        self.phases["time/trainer_onload_wait_s"] = time.monotonic() - t0

    async def _sync_parts(self) -> dict[str, float]:
        """Where the sync's seconds went, whatever its transport: assembling the HF-named weights
        (``gather``), laying them out for the transport (``pack``: one buffer, a dir, a pickle) and the
        engines taking them in (``push``); see :func:`agentrl.weight_sync.sync_phases`."""
        phases = sync_phases(await self.trainer.last_sync_stats())
        return {f"time/weight_sync_{phase}_s": seconds for phase, seconds in phases.items()}


class OnloadAhead:
    """When a colocated step's trainer onload starts (``colocation.trainer_offload: ahead``): before the
    batch is complete, so that the copy back to the GPU runs beside the last of the generation instead of
    after it.

    It starts ``lead`` seconds into the wait for the batch: the shortest of the last few waits less the
    longest of the last few onloads and a margin, so that it is done when a batch that comes as early as
    lately is in; a batch that comes earlier waits for the rest, and none waits longer than it would have
    with the onload after it. Until a step was measured, and when off, ``lead`` is None and the onload
    waits for the batch."""

    HISTORY = 5  # steps the lead is taken from
    MARGIN_S = 0.05  # the onload ends this long before the earliest recent batch

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.waits: list[float] = []
        self.onloads: list[float] = []
        self._go: asyncio.Event | None = None

    @property
    def lead(self) -> float | None:
        """Seconds into the wait at which the next onload starts (None: once the batch is in)."""
        if not (self.enabled and self.waits and self.onloads):
            return None
        return max(0.0, min(self.waits) - max(self.onloads) - self.MARGIN_S)

    def start(
        self, trainer: TrainerGroup, offloading: asyncio.Future[float] | None
    ) -> asyncio.Future[float] | None:
        """At the start of the wait: the onload, under way (it returns its seconds), or None without a
        lead."""
        lead = self.lead
        if lead is None:
            return None
        self._go = asyncio.Event()
        return asyncio.ensure_future(self._onload(trainer, offloading, lead, self._go))

    def now(self) -> None:
        """The batch is in: an onload still waiting for its lead starts now."""
        if self._go is not None:
            self._go.set()
            self._go = None

    def observe(self, wait: float, phases: dict[str, float]) -> None:
        """A step's wait for its batch and its onload's own seconds (``time/trainer_onload_s``)."""
        if "time/trainer_onload_s" not in phases:
            return
        self.waits = [*self.waits, wait][-self.HISTORY :]
        self.onloads = [*self.onloads, phases["time/trainer_onload_s"]][-self.HISTORY :]

    @staticmethod
    async def _onload(
        trainer: TrainerGroup, offloading: asyncio.Future[float] | None, lead: float, go: asyncio.Event
    ) -> float:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(go.wait(), lead)
        if offloading is not None:
            await asyncio.shield(offloading)  # to_trainer reads its result too
        return await _seconds(trainer.onload())
