"""One generation request inside the embedded engine: its state while it runs, its tokens as they come,
and its record once done.

:class:`EngineRequest` is what :class:`~agentrl.embedded.engine.EmbeddedEngine` and its
:class:`~agentrl.embedded.scheduler.Scheduler` share about a request (tokens so far, slot, abort flag, the
future its caller awaits, the hook that sees each sampled token); :class:`GenerationRecord` is what the
caller gets back. :class:`TokenStream` is the streaming form of a request: an async iterator of its newly
sampled tokens (:class:`TokenDelta`), with the record once it ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.embedded.sampling import RequestSampling


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
    routed_experts: Any = None  # MoE: int32 tensor [tokens, layers, k] (every input position), else None


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
    on_token: Callable[[int, float], None] | None = None  # called with each sampled token; must not raise
    routed_experts: Any = None  # MoE: the experts of every input position, read when it finishes


@dataclass
class TokenDelta:
    """Tokens a request sampled since the last delta, with their logprobs (raw-model, as the record's)."""

    ids: list[int]
    logprobs: list[float]


class TokenStream:
    """One request's tokens as they are sampled: ``async for delta in stream`` yields :class:`TokenDelta`
    (every token that arrived since the previous one, so a slow reader gets them batched); after the
    last one ``record`` holds the :class:`GenerationRecord`. An engine error is raised by the iteration.
    Leaving early (``aclose``, or the reader cancelled) cancels the request, which aborts it in the engine.

    ``start(on_token)`` starts the generation with a per-token hook and returns its record's awaitable
    (``EmbeddedEngine.stream`` passes its ``generate``)."""

    def __init__(self, start: Callable[[Callable[[int, float], None]], Awaitable[GenerationRecord]]) -> None:
        self._queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
        self._task = asyncio.ensure_future(start(self._token))
        self._task.add_done_callback(lambda _: self._queue.put_nowait(None))
        self._ended = False
        self.record: GenerationRecord | None = None

    def _token(self, token: int, logprob: float) -> None:
        self._queue.put_nowait((token, logprob))

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            self._task.cancel()
            raise
        delta = TokenDelta([], [])
        while item is not None:
            delta.ids.append(item[0])
            delta.logprobs.append(item[1])
            if self._queue.empty():
                return delta
            item = self._queue.get_nowait()
        self._ended = True
        self.record = self._task.result()  # the engine's error, if it failed
        if delta.ids:
            return delta
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop reading: a request still running is cancelled (aborted in the engine)."""
        self._ended = True
        if not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


__all__ = ["EngineFailed", "EngineRequest", "GenerationRecord", "TokenDelta", "TokenStream"]
