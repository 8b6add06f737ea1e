"""Inference engines speaking SGLang's native HTTP API: the async client, the SGLang launcher and the
embedded engine (a labelled stand-in for SGLang that runs on CPU or one GPU).

Only light modules are imported here; ``embedded_server`` and ``launcher`` pull in torch / subprocess
machinery and are imported where used.
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
