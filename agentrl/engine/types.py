"""What goes into and comes out of an engine's ``/generate``, in SGLang's field names.

:class:`SamplingParams` serializes to SGLang's ``sampling_params`` object; :class:`GenerateResult` is the
parsed answer (sampled ids, their logprobs, the finish reason and the engine's weight version).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from agentrl.config import ConfigModel

FinishReason = Literal["stop", "length", "abort"]


class SamplingParams(ConfigModel):
    """Per-request sampling parameters (SGLang ``sampling_params``)."""

    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(-1, description="-1 disables top-k")
    max_new_tokens: int = Field(256, ge=1, description="tokens to sample at most")
    stop: list[str] = Field(default_factory=list, description="stop strings (kept in the output)")
    stop_token_ids: list[int] = Field(default_factory=list, description="extra stop token ids")
    ignore_eos: bool = Field(False, description="keep sampling past EOS")
    no_stop_trim: bool = Field(True, description="keep the matched stop string in the output")
    skip_special_tokens: bool = Field(False, description="drop special tokens from text")
    sampling_seed: int | None = Field(None, description="per-request seed")

    def to_sglang(self) -> dict[str, Any]:
        d: dict[str, Any] = self.model_dump(exclude_none=True)
        if not d["stop"]:
            d.pop("stop")
        if not d["stop_token_ids"]:
            d.pop("stop_token_ids")
        return d


@dataclass
class GenerateResult:
    """One ``/generate`` answer."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    matched: int | str | None = None
    weight_version: str | None = None
    prompt_tokens: int = 0
    rid: str = ""
    text: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @classmethod
    def from_sglang(cls, body: dict[str, Any]) -> GenerateResult:
        """Parse SGLang's answer (``output_ids`` + ``meta_info.output_token_logprobs``)."""
        meta = body.get("meta_info") or {}
        fr = meta.get("finish_reason") or {}
        if isinstance(fr, str):
            fr = {"type": fr}
        lp_entries = meta.get("output_token_logprobs") or []
        ids = body.get("output_ids")
        if ids is None:
            ids = [int(e[1]) for e in lp_entries]
        logprobs = [float(e[0]) for e in lp_entries]
        if len(logprobs) != len(ids):
            raise ValueError(f"engine answered {len(ids)} output ids but {len(logprobs)} logprobs")
        reason = fr.get("type", "stop")
        if reason not in ("stop", "length", "abort"):
            reason = "stop"
        wv = meta.get("weight_version")
        return cls(
            output_ids=[int(i) for i in ids],
            logprobs=logprobs,
            finish_reason=reason,
            matched=fr.get("matched"),
            weight_version=None if wv is None else str(wv),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            rid=str(meta.get("id", "")),
            text=body.get("text", ""),
            meta=meta,
        )
