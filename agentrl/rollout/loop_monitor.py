"""How loaded an asyncio event loop is: the share of wall time it was busy, and how late it wakes up.

A rollout runs every episode on one event loop (the orchestrator's). When that loop is saturated, every
reply from an engine or a tool waits behind the callbacks already queued, and the engines get their next
requests late. :class:`LoopMonitor` measures it over windows that :meth:`LoopMonitor.snapshot` closes:

* ``loop_busy_frac``: 1 - (time the loop sat in its selector waiting for I/O or a timer) / wall time.
  The selector's ``select`` is timed, two clock reads a loop iteration, so everything else counts as
  busy: running callbacks, and time the loop's thread waited for the GIL, sat in a blocking call or was
  descheduled by the OS (a machine with fewer free cores than busy processes). Near 1 the loop is
  saturated. This needs a loop with a selector (asyncio's own); on one without (uvloop,
  which Ray picks when it is installed) the figure is the loop thread's CPU time instead, which misses
  GIL waits and blocking calls (the log says which method a monitor uses).
* ``loop_cpu_frac``: the loop thread's CPU time / wall time. Busy minus CPU is time the loop was neither
  idle nor computing: waiting for the GIL (other threads of the process), for a core, or in blocking
  calls.
* ``loop_lag_ms_p50`` / ``_p90`` / ``_max``: a probe task sleeps ``interval`` seconds over and over and
  records how much later than asked it woke, which is what any coroutine whose I/O or timer is ready
  waits for the loop. An idle loop wakes within about a millisecond (epoll's timeout resolution).

Cost: two clock reads a loop iteration and one probe wake-up every ``interval`` (10 ms: 100 a second,
about 0.3% of a core).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from typing import Any

log = logging.getLogger(__name__)


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else 0.0


class LoopMonitor:
    """See the module docstring. ``start()`` on the loop to watch, ``snapshot()`` per window, ``stop()``."""

    def __init__(self, interval: float = 0.01, max_samples: int = 65536, use_selector: bool = True) -> None:
        self.interval = interval
        self.use_selector = use_selector  # False: CPU time even where the selector could be timed
        self._lags: deque[float] = deque(maxlen=max_samples)
        self._probe: asyncio.Task[None] | None = None
        self._selector: Any = None
        self._wrapper: Any = None
        self._idle = 0.0  # seconds spent in the selector, since start
        self._thread = 0
        self._cpu = 0.0  # the loop thread's CPU time at the probe's last wake-up
        self._t0 = self._idle0 = self._cpu0 = 0.0

    @property
    def running(self) -> bool:
        return self._probe is not None

    @property
    def exact(self) -> bool:
        """True when busy time comes from timing the selector (not from CPU time)."""
        return self._wrapper is not None

    def start(self) -> None:
        """Watch the running loop (idempotent)."""
        if self._probe is not None:
            return
        loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        if self.use_selector:
            self._time_selector(getattr(loop, "_selector", None))
        self._lags.clear()
        self._t0, self._idle0, self._cpu0 = time.perf_counter(), self._idle, time.thread_time()
        self._cpu = self._cpu0
        self._probe = loop.create_task(self._run_probe(), name="loop-monitor")
        log.info("event loop monitor: busy time from %s", "its selector" if self.exact else "CPU time")

    def _time_selector(self, selector: Any) -> None:
        inner = getattr(selector, "select", None)
        if not callable(inner):
            return
        monitor = self

        def select(timeout: float | None = None) -> Any:
            t = time.perf_counter()
            try:
                return inner(timeout)
            finally:
                if monitor._wrapper is select:  # a stopped monitor's wrapper only passes through
                    monitor._idle += time.perf_counter() - t

        try:
            selector.select = select  # an instance attribute shadows the class's method
        except AttributeError:  # a selector with __slots__: CPU time instead
            return
        self._selector, self._wrapper = selector, select

    def stop(self) -> None:
        """Stop the probe and give the selector its own ``select`` back (idempotent)."""
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        sel, wrapper, self._wrapper, self._selector = self._selector, self._wrapper, None, None
        if sel is not None and sel.__dict__.get("select") is wrapper:
            del sel.select
        # else someone wrapped it after us: ours stays in their chain, passing through without counting

    async def _run_probe(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                due = loop.time() + self.interval
                await asyncio.sleep(self.interval)
                self._lags.append(max(0.0, loop.time() - due))
                self._cpu = time.thread_time()

    def snapshot(self, reset_window: bool = True) -> dict[str, float]:
        """The window's figures (see the module docstring); empty when the monitor is not running."""
        if self._probe is None:
            return {}
        now = time.perf_counter()
        wall = max(now - self._t0, 1e-9)
        cpu_now = time.thread_time() if threading.get_ident() == self._thread else self._cpu
        cpu = min(1.0, max(0.0, (cpu_now - self._cpu0) / wall))
        busy = 1.0 - (self._idle - self._idle0) / wall if self.exact else cpu
        lags = sorted(self._lags)
        out = {
            "loop_busy_frac": min(1.0, max(0.0, busy)),
            "loop_cpu_frac": cpu,
            "loop_lag_ms_p50": 1000 * _pct(lags, 0.5),
            "loop_lag_ms_p90": 1000 * _pct(lags, 0.9),
            "loop_lag_ms_max": 1000 * (lags[-1] if lags else 0.0),
        }
        if reset_window:
            self._t0, self._idle0, self._cpu0 = now, self._idle, cpu_now
            self._lags.clear()
        return out
