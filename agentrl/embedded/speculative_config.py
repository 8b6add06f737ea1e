"""The embedded engine's speculative decoding settings (``engine.speculative`` of a run, the server's
``--speculative`` flags), apart from the drafter and the verify step (:mod:`agentrl.embedded.speculative`),
so that a run's config loads without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from agentrl.config import ConfigModel

__all__ = ["Acceptance", "SpeculativeConfig"]

Acceptance = Literal["exact", "rejection"]


class SpeculativeConfig(ConfigModel):
    """How the embedded engine speculates (``engine.speculative`` of a run; the server's ``--speculative``
    flags): the drafter and its sizes, and the acceptance rule."""

    method: Literal["ngram"] = Field(
        "ngram", description="ngram: prompt lookup over the request's own context (no draft model)"
    )
    num_draft_tokens: int = Field(4, ge=1, description="tokens drafted per request and step, at most")
    max_ngram: int = Field(3, ge=1, description="the longest suffix of the context looked up")
    min_ngram: int = Field(
        2, ge=1, description="the shortest suffix looked up (1 drafts more, and misses more)"
    )
    shared_tokens: int = Field(
        0,
        ge=0,
        description="where a request's own context has no match, also look its suffix up in what the "
        "engine's other requests generated (a group's samples, a policy's habitual phrasing), up to this "
        "many generated tokens remembered; 0: the request's own context only",
    )
    adaptive: bool = Field(
        True,
        description="speculate only while a verify step emits more tokens per second than a decode step "
        "(measured as the engine runs, with a verify step now and then to look again); false: every "
        "decode step with a draft verifies",
    )
    acceptance: Acceptance = Field(
        "exact",
        description="exact: a drafted token is kept only where it equals the token sampled there (the "
        "tokens and logprobs of the run without speculation); rejection: standard speculative sampling "
        "(the target distribution, not the same tokens)",
    )

    @model_validator(mode="after")
    def _sizes(self) -> SpeculativeConfig:
        if self.min_ngram > self.max_ngram:
            raise ValueError("speculative n-gram sizes need min_ngram <= max_ngram")
        return self
