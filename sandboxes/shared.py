"""One sandbox per event loop and backend, shared by every episode and verifier that does not bring its own.

Envs are created per episode, but a sandbox (a warm container pool) should live for the whole run; this
is where that long-lived instance comes from. ``AGENTRL_SANDBOX`` (docker | process | auto) picks the
default backend.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from typing import Any

from .base import Sandbox, make_sandbox

_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Sandbox]] = (
    weakref.WeakKeyDictionary()
)


def shared_sandbox(backend: str | None = None, **config: Any) -> Sandbox:
    """The process-wide sandbox of this event loop for ``backend`` (created on first use with ``config``)."""
    backend = backend or os.environ.get("AGENTRL_SANDBOX", "auto")
    per_loop = _SHARED.setdefault(asyncio.get_running_loop(), {})
    sb = per_loop.get(backend)
    if sb is None or getattr(sb, "_closed", False):
        sb = per_loop[backend] = make_sandbox(backend, **config)
    return sb


async def close_shared_sandboxes() -> None:
    """Close the shared sandboxes of the running loop (call at the end of a run)."""
    per_loop = _SHARED.pop(asyncio.get_running_loop(), {})
    for sb in per_loop.values():
        await sb.close()
