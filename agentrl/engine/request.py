"""One generation request inside the embedded engine: its state while it runs, and its record once done.

:class:`EngineRequest` is what :class:`~agentrl.engine.embedded.EmbeddedEngine` and its
:class:`~agentrl.engine.scheduler.Scheduler` share about a request (tokens so far, slot, abort flag, the
future its caller awaits); :class:`GenerationRecord` is what the caller gets back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.engine.sampling import RequestSampling


class EngineFailed(RuntimeError):
    """The generation loop failed on a request (answered 500)."""


@dataclass
class GenerationRecord:
    """What one finished request produced (the server turns it into SGLang's JSON)."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]
    weight_version: str
    latency: float
    cached_tokens: int = 0


@dataclass(eq=False)
class EngineRequest:
    """A request in flight: waiting for a slot, running in one, or held while the engine is paused."""

    rid: str
    prompt_ids: list[int]
    sampling: RequestSampling
    seed: int
    stop_ids: set[int]
    seq: list[int] = field(default_factory=list)  # prompt + output: what the next step continues
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    abort: bool = False
    poke: asyncio.Event = field(default_factory=asyncio.Event)  # abort while waiting for continue
    outcome: asyncio.Future | None = None  # set by the loop when the request leaves the engine
    slot: int = -1
    cached: int = 0  # positions of seq whose KV is in the slot
    prefilling: bool = True
    epoch: int = 0  # prefix-cache epoch at admission (KV from older weights is never cached)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    created: float = field(default_factory=time.perf_counter)


__all__ = ["EngineFailed", "EngineRequest", "GenerationRecord"]
