"""One engine endpoint as :class:`~agentrl.engine.client.EngineClient` keeps it, and the errors a call to an
engine raises (the client's, the adapter naming's and every caller's: ``from agentrl.engine.client import
EngineError`` finds them too)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

__all__ = ["Endpoint", "EngineError", "EngineRequestError", "EngineTimeout", "EngineUnavailable"]


class EngineError(RuntimeError):
    """Base of every engine-call failure."""


class EngineUnavailable(EngineError):
    """The engine could not be reached, or kept answering 5xx, after all retries."""


class EngineTimeout(EngineError):
    """The engine did not answer within the client's timeout."""


class EngineRequestError(EngineError):
    """The engine rejected the request (4xx, or ``success: false``); carries the server's message."""

    def __init__(self, message: str, status: int | None = None, url: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.url = url


@dataclass
class Endpoint:
    """One engine as the client keeps it: its URL, its requests in flight, when it failed last, and the
    LoRA adapter its ``/generate`` names (:mod:`agentrl.engine.adapters`)."""

    url: str
    in_flight: int = 0
    # After a connection failure the endpoint is avoided for a short while when others are available.
    down_until: float = 0.0
    adapter: str | None = None  # the LoRA adapter every /generate here names (SGLang's lora_path)
    adapter_known: bool = False  # False: ask the engine (GET /v1/models) before the next /generate
    lookup: asyncio.Task[str | None] | None = None  # that question, while it is asked
