"""Talking to any engine that speaks SGLang's native HTTP API: the async client, the SGLang launcher, the
weight-broadcast process group and the OpenAI front end over token-in/token-out generation.

The embedded stand-in engine (CPU or one GPU) lives in :mod:`agentrl.embedded`. Only light modules are
imported here; ``launcher`` pulls in subprocess machinery and is imported where used.
"""

from agentrl.engine.client import (
    EngineClient,
    EngineError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)
from agentrl.engine.types import FinishReason, GenerateResult, SamplingParams

__all__ = [
    "EngineClient",
    "EngineError",
    "EngineRequestError",
    "EngineTimeout",
    "EngineUnavailable",
    "FinishReason",
    "GenerateResult",
    "SamplingParams",
]
