"""Sampling for the embedded engine: per-request parameters, counter-based seeded noise, raw logprobs.

A request's ``sampling_params`` (SGLang's names) become a :class:`RequestSampling`. One decode step then
samples every row at once on the device (:func:`sample_tokens`): temperature, top-k, top-p and min-p per
row, greedy where the temperature is 0, by the Gumbel-max trick with noise that is a **hash of (seed,
position, vocabulary id)**. The noise of a row therefore depends on nothing but its request's seed and
the position being sampled: not on which other requests share the step, not on a generator's state,
not on whether the request was retracted and resumed. Requests without a ``sampling_seed`` get one
drawn from the engine's seeded generator when they arrive.

The logprob returned is ``log_softmax`` of the **raw fp32 logits** at the sampled id, the quantity a
trainer recomputes (SGLang with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``), not that of the processed
distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_M64 = (1 << 64) - 1


class EngineBadRequest(ValueError):
    """The request is invalid (answered 400)."""


@dataclass
class RequestSampling:
    """Validated SGLang ``sampling_params`` for one request."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    @classmethod
    def from_sglang(cls, d: dict[str, Any] | None, default_max_new_tokens: int) -> RequestSampling:
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        # SGLang accepts more knobs (penalties, regex, json_schema, n ...); those we cannot honour are errors,
        # not silently ignored, except the few that do not change sampling.
        harmless = {"spaces_between_special_tokens", "logit_bias", "custom_params", "stream_interval"}
        unknown = sorted(k for k in d if k not in known and k not in harmless and d[k] is not None)
        penalties = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}
        unknown = [k for k in unknown if not (k in penalties and d[k] == penalties[k])]
        if d.get("logit_bias"):
            unknown.append("logit_bias")
        if unknown:
            raise EngineBadRequest(
                f"sampling_params not supported by the embedded engine: {', '.join(unknown)}"
            )
        kw: dict[str, Any] = {k: d[k] for k in known if d.get(k) is not None}
        if isinstance(kw.get("stop"), str):
            kw["stop"] = [kw["stop"]]
        if isinstance(kw.get("stop_token_ids"), int):
            kw["stop_token_ids"] = [kw["stop_token_ids"]]
        kw.setdefault("max_new_tokens", default_max_new_tokens)
        try:
            s = cls(**kw)
            s.temperature = float(s.temperature)
            s.top_p = float(s.top_p)
            s.top_k = int(s.top_k)
            s.min_p = float(s.min_p)
            s.max_new_tokens = int(s.max_new_tokens)
            s.stop = [str(x) for x in s.stop]
            s.stop_token_ids = [int(x) for x in s.stop_token_ids]
            s.sampling_seed = None if s.sampling_seed is None else int(s.sampling_seed)
        except (TypeError, ValueError) as err:
            raise EngineBadRequest(f"invalid sampling_params: {err}") from None
        if s.temperature < 0:
            raise EngineBadRequest("sampling_params.temperature must be >= 0")
        if not 0.0 < s.top_p <= 1.0:
            raise EngineBadRequest("sampling_params.top_p must be in (0, 1]")
        if s.top_k == 0 or s.top_k < -1:
            raise EngineBadRequest("sampling_params.top_k must be -1 (off) or >= 1")
        if not 0.0 <= s.min_p <= 1.0:
            raise EngineBadRequest("sampling_params.min_p must be in [0, 1]")
        if s.max_new_tokens < 0:
            raise EngineBadRequest("sampling_params.max_new_tokens must be >= 0")
        if any(not x for x in s.stop):
            raise EngineBadRequest("sampling_params.stop must not contain empty strings")
        return s


def row_key(seed: int, position: int) -> int:
    """A 32-bit key (as a signed int) of (seed, position), mixed with splitmix64's finaliser."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z = (z ^ (z >> 31)) & 0xFFFFFFFF
    return z - (1 << 32) if z & 0x80000000 else z


def uniform_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) floats [rows, vocab]: murmur3's 32-bit finaliser of ``key ^ (id * golden)``.
    int32 arithmetic wraps; ``>>`` on int32 is arithmetic, so each shift is masked to be logical."""
    ids = torch.arange(vocab, dtype=torch.int32, device=keys.device) * -1640531527  # 0x9E3779B9
    x = keys.to(torch.int32)[:, None] ^ ids[None]
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * -2048144789  # 0x85EBCA6B
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * -1028477387  # 0xC2B2AE35
    x = x ^ ((x >> 16) & 0xFFFF)
    return (((x >> 8) & 0xFFFFFF).float() + 0.5) * (1.0 / (1 << 24))


def gumbel_max(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max sample of each row of scaled logits ``x``, its noise keyed by ``keys`` [rows]."""
    u = uniform_noise(keys, x.shape[-1])
    return (x - torch.log(-torch.log(u))).argmax(dim=-1)


_gumbel_max = gumbel_max


def compile_sampler() -> None:
    """Fuse the noise hash, Gumbel transform and argmax into a few kernels (GPU; ~20 passes over
    [rows, vocab] otherwise). Same values: integer hashing, then the same float ops."""
    global _gumbel_max
    _gumbel_max = torch.compile(gumbel_max, dynamic=True)


def filter_logits(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Per-row top-k, top-p and min-p on temperature-scaled logits (``top_k`` = vocab, ``top_p`` = 1 and
    ``min_p`` = 0 switch a filter off for a row)."""
    neg = torch.finfo(x.dtype).min
    vocab = x.shape[-1]
    if bool((top_k < vocab).any()):
        kmax = int(top_k.max())
        top = torch.topk(x, kmax, dim=-1).values
        kth = top.gather(1, (top_k - 1).clamp(max=kmax - 1).unsqueeze(-1))
        x = x.masked_fill(x < kth, neg)
    if bool((top_p < 1.0).any()):
        sorted_asc, order = torch.sort(x, dim=-1)
        cum = torch.softmax(sorted_asc, dim=-1).cumsum(-1)
        remove = cum <= (1.0 - top_p).unsqueeze(-1)
        remove[:, -1] = False  # always keep the most likely token
        x = x.masked_fill(remove.scatter(1, order, remove), neg)
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p.unsqueeze(-1) * probs.max(dim=-1, keepdim=True).values, neg)
    return x


def sample_tokens(
    logits: torch.Tensor, params: list[RequestSampling], seeds: list[int], positions: list[int]
) -> tuple[list[int], list[float]]:
    """Sample one token per row of fp32 ``logits`` [rows, vocab]; row ``r`` follows ``params[r]`` with noise
    keyed by (``seeds[r]``, ``positions[r]``). Returns the ids and their raw-logit logprobs (one host sync)."""
    dev, vocab = logits.device, logits.shape[-1]
    tokens = logits.argmax(dim=-1)  # temperature 0 = greedy
    temps = [p.temperature for p in params]
    if any(t > 0 for t in temps):
        temp = torch.tensor([t if t > 0 else 1.0 for t in temps], device=dev)
        x = logits / temp[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
            x = filter_logits(
                x,
                torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev),
                torch.tensor([p.top_p for p in params], device=dev),
                torch.tensor([p.min_p for p in params], device=dev),
            )
        keys = torch.tensor([row_key(s, q) for s, q in zip(seeds, positions, strict=True)], dtype=torch.int32)
        picked = _gumbel_max(x, keys.to(dev))
        if all(t > 0 for t in temps):
            tokens = picked
        else:
            tokens = torch.where(torch.tensor([t > 0 for t in temps], device=dev), picked, tokens)
    logp = logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
    both = torch.cat([tokens.double(), logp.double()]).tolist()  # one device-to-host copy
    n = len(params)
    return [int(t) for t in both[:n]], both[n:]


__all__ = [
    "EngineBadRequest",
    "RequestSampling",
    "compile_sampler",
    "filter_logits",
    "gumbel_max",
    "row_key",
    "sample_tokens",
    "uniform_noise",
]
