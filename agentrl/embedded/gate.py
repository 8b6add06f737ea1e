"""The embedded engine's gate: whether a request may enter the engine now, and the drain a weight update waits
on.

A request enters the engine's schedule only while the gate is open: neither paused (``pause`` until
``continue``) nor asleep (from the start of a memory release until every released tag is resumed).
Inside, it holds the gate's :attr:`RequestGate.drain` for reading; a weight update or a release takes it
for writing, which waits for the requests inside to finish and holds new ones back meanwhile.
"""

from __future__ import annotations

import asyncio

from agentrl.embedded.request import EngineRequest
from agentrl.embedded.sampling import EngineBadRequest
from agentrl.embedded.weights import DrainLock

PAUSE_MODES = ("abort", "retract", "in_place")


class RequestGate:
    """Pause, sleep and drain of the embedded engine's requests (see the module docstring)."""

    def __init__(self) -> None:
        self.drain = DrainLock()
        self._open = asyncio.Event()  # set while requests may enter: neither paused nor asleep
        self._open.set()
        self.paused_mode: str | None = None
        self.sleeping = False  # from the start of a release until every tag is resumed

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def pause(self, mode: str) -> None:
        """Hold new requests until :meth:`unpause`; ``mode`` (abort, retract or in_place) is what the engine
        does with those in flight."""
        if mode not in PAUSE_MODES:
            raise EngineBadRequest(f"pause mode must be abort, retract or in_place, not {mode!r}")
        self.paused_mode = mode
        self._update()

    def unpause(self) -> None:
        """End a pause; requests enter again unless the engine is asleep (then they wait for the wake)."""
        self.paused_mode = None
        self._update()

    def sleep(self) -> None:
        self.sleeping = True
        self._update()

    def wake(self) -> None:
        self.sleeping = False
        self._update()

    def _update(self) -> None:
        if self.paused_mode is None and not self.sleeping:
            self._open.set()
        else:
            self._open.clear()

    async def wait_or_abort(self, req: EngineRequest) -> bool:
        """Wait for the gate to open; True if the request was aborted meanwhile (it then answers abort)."""
        waiter = asyncio.ensure_future(self._open.wait())
        poked = asyncio.ensure_future(req.poke.wait())
        await asyncio.wait({waiter, poked}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        poked.cancel()
        if req.abort:
            req.finish = {"type": "abort", "message": "aborted while waiting"}
            return True
        return False


__all__ = ["PAUSE_MODES", "RequestGate"]
