"""Sampling for the embedded engine: per-request parameters, counter-based seeded draws, raw logprobs.

A request's ``sampling_params`` (SGLang's names) become a :class:`RequestSampling`. One decode step then
samples every row at once on the device (:func:`sample_tokens`): temperature, top-k, top-p and min-p per
row, greedy where the temperature is 0, by inverse-CDF sampling (two levels: blocks of the vocabulary,
then inside one block) with one uniform draw per token that is a **hash of (seed, position)**, computed
on the device. The draw of a row therefore depends on nothing but its request's seed and
the position being sampled: not on which other requests share the step, not on a generator's state,
not on whether the request was retracted and resumed. Requests without a ``sampling_seed`` get one
drawn from the engine's seeded generator when they arrive.

The logprob returned is ``log_softmax`` of the **raw fp32 logits** at the sampled id, the quantity a
trainer recomputes (SGLang with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``), not that of the processed
distribution.
"""

from __future__ import annotations

import functools
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


def signed64(x: int) -> int:
    """``x`` mod 2**64 as a signed 64-bit int (how a seed travels in an int64 tensor)."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


_K1, _K2, _K3 = (signed64(k) for k in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def row_key(seed: int, position: int) -> int:
    """A 32-bit key (as a signed int) of (seed, position), mixed with splitmix64's finaliser."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z = (z ^ (z >> 31)) & 0xFFFFFFFF
    return z - (1 << 32) if z & 0x80000000 else z


def row_uniform(seed: int, position: int) -> float:
    """The uniform (0, 1) draw of (seed, position): 24 bits of :func:`row_key`."""
    return (((row_key(seed, position) >> 8) & 0xFFFFFF) + 0.5) / (1 << 24)


def row_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """:func:`row_uniform` of int64 tensors, on their device, as float32 (bit-equal to the scalar version
    rounded to float32). int64 products wrap mod 2**64; right shifts are made logical by masking."""
    z = seeds * _K1 + positions * _K2 + _K3
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _K2
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _K3
    z = (z ^ ((z >> 31) & ((1 << 33) - 1))) & 0xFFFFFFFF
    return ((((z >> 8) & 0xFFFFFF).double() + 0.5) / (1 << 24)).float()


@functools.lru_cache(maxsize=16)
def block_size(vocab: int, target: int = 1024) -> int:
    """A block length for :func:`inverse_cdf`: a divisor of ``vocab`` near ``target`` if there is one
    (then the blocks are a view, no padded copy), else ``target``."""
    for d in sorted(range(256, 4097), key=lambda d: abs(d - target)):
        if vocab % d == 0:
            return d
    return target


def inverse_cdf(
    x: torch.Tensor, u: torch.Tensor, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of scaled (and filtered) logits ``x``, the token whose CDF interval holds ``u[row]``,
    and the row's log-normaliser ``logsumexp(x)``.

    Two levels, so no scan runs over the whole vocabulary: the unnormalised mass of each block of
    tokens (:func:`block_size`), a cumulative sum over blocks to find the block that holds ``u``, then a
    cumulative sum inside that one block. A handful of passes over ``x``, no sort."""
    rows, vocab = x.shape
    block = block or block_size(vocab)
    nb = -(-vocab // block)
    m = x.max(dim=-1, keepdim=True).values
    e = torch.sub(x, m).exp_()
    if nb * block != vocab:
        e = torch.nn.functional.pad(e, (0, nb * block - vocab))
    e = e.view(rows, nb, block)
    cum = e.sum(-1).cumsum(-1)  # [rows, nb]
    target = (u * cum[:, -1])[:, None]
    b = torch.searchsorted(cum, target).clamp(max=nb - 1)  # [rows, 1]
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    inner = e.gather(1, b[:, :, None].expand(rows, 1, block)).squeeze(1).cumsum(-1)
    # clamped to the block's own total (summed in another order): the first index reaching it has mass
    j = torch.searchsorted(inner, torch.minimum(target - before, inner[:, -1:])).clamp(max=block - 1)
    return (b * block + j).squeeze(1).clamp(max=vocab - 1), m.squeeze(1) + cum[:, -1].log()


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
    logits: torch.Tensor,
    params: list[RequestSampling],
    seeds: list[int],
    positions: list[int],
    invariant_rows: int | None = None,
) -> tuple[list[int], list[float]]:
    """Sample one token per row of fp32 ``logits`` [rows, vocab]; row ``r`` follows ``params[r]``
    with its draw keyed by (``seeds[r]``, ``positions[r]``). Returns the ids and their raw-logit
    logprobs (one host sync).

    ``invariant_rows`` (batch-invariant mode): the logprobs are :func:`agentrl.batch_invariant.token_logprobs`
    (the true on-policy trainer's formula), and on a GPU the rows are padded to this many, so every step
    runs the same kernel shapes and a row's draw does not depend on how many rows share the step."""
    real = len(params)
    if invariant_rows is not None and logits.is_cuda and real < invariant_rows:
        pad = invariant_rows - real
        logits = torch.nn.functional.pad(logits, (0, 0, 0, pad))
        params, seeds, positions = (
            [*params, *[RequestSampling()] * pad],
            [*seeds, *[0] * pad],
            [*positions, *[0] * pad],
        )
    dev, vocab, n = logits.device, logits.shape[-1], len(params)
    temps = [p.temperature for p in params]
    if any(t > 0 for t in temps):
        x, raw = logits, True  # raw: x is the logits themselves, so its normaliser is the logprobs' one
        if any(t != 1.0 for t in temps):
            x, raw = logits / torch.tensor([t if t > 0 else 1.0 for t in temps], device=dev)[:, None], False
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
            top_p = torch.tensor([p.top_p for p in params], device=dev)
            x, raw = (
                filter_logits(x, top_k, top_p, torch.tensor([p.min_p for p in params], device=dev)),
                False,
            )
        keys = torch.tensor([signed64(s) for s in seeds] + list(positions), dtype=torch.long)
        if dev.type == "cuda":  # from pinned memory without a wait: the step's forward may still be running
            keys = keys.pin_memory()
        keys = keys.to(dev, non_blocking=True)
        tokens, log_z = inverse_cdf(x, row_uniforms(keys[:n], keys[n:]))
        if not raw:
            log_z = torch.logsumexp(logits, dim=-1)
        if not all(t > 0 for t in temps):
            greedy = torch.tensor([t == 0 for t in temps], device=dev)
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    else:
        tokens, log_z = logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)
    logp = logits.gather(1, tokens[:, None]).squeeze(1) - log_z
    if invariant_rows is not None:
        from agentrl.batch_invariant import token_logprobs

        logp = token_logprobs(logits, tokens)
    if n > real:
        tokens, logp, n = tokens[:real], logp[:real], real
    both = torch.cat([tokens.double(), logp.double()])
    if dev.type == "cuda":  # one device-to-host copy, waited for with the GIL released (HTTP goes on)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        both = host
    out = both.tolist()
    return [int(t) for t in out[:n]], out[n:]


__all__ = [
    "EngineBadRequest",
    "RequestSampling",
    "block_size",
    "filter_logits",
    "inverse_cdf",
    "row_key",
    "row_uniform",
    "row_uniforms",
    "sample_tokens",
    "signed64",
]
