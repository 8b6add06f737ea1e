"""Inference engines speaking SGLang's native HTTP API: the async client, the SGLang launcher and the
embedded engine (a labelled stand-in for SGLang that runs on CPU or one GPU)."""

from agentrl.engine.types import FinishReason, GenerateResult, SamplingParams

__all__ = ["FinishReason", "GenerateResult", "SamplingParams"]
