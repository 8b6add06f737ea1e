"""Speculative decoding in the embedded engine: drafts of the next few tokens, verified by the served model
in one forward, so that a decode step can emit several tokens without changing any of them.

A :class:`Drafter` proposes, for each decoding request, up to ``k`` tokens that may follow its context;
:class:`NgramDrafter` (prompt lookup) finds the latest earlier place where the context's last ``n`` tokens
occurred (``n`` from ``max_ngram`` down to ``min_ngram``) and proposes what followed there. Agent episodes
copy a lot from their own context (a name out of a retrieved passage, a tool call's arguments, code's
identifiers), so these drafts need no draft model and no weight sync. Another drafter (a small draft
model, a model's MTP head) fits behind the same interface.

The scheduler (:mod:`.scheduler`) runs the model once over ``[last token, draft...]`` of every decoding
request and then samples every one of those positions as a plain decode step would sample it: with the
draw of (seed, position) (:mod:`.sampling`). **Exact acceptance**: a drafted token is kept exactly when it
equals the token sampled at its position, and the first position where they differ emits its own sample,
so every emitted token is the token, with the logprob, the non-speculative run emits there. Bit for bit
where the forward's bits do not depend on how many tokens it runs at once (batch-invariant mode);
otherwise up to the rounding by which the engine's prefill and decode differ.

**Rejection acceptance** (:func:`rejection_verify`): standard speculative sampling for a point-mass
draft, accepting a drafted token ``d`` with probability ``p(d)`` and otherwise sampling from ``p`` with
``d`` removed. It keeps the target distribution but not the non-speculative run's tokens; it accepts as
often as exact acceptance does (``p(d)`` per position), so it is there for comparison and for drafters that
cannot use the engine's draws.
"""

from __future__ import annotations

from array import array
from typing import Protocol

import torch

from agentrl.embedded.sampling import RequestSampling, filter_logits, inverse_cdf, row_uniform
from agentrl.embedded.speculative_config import Acceptance, SpeculativeConfig

_WORD = array("i").itemsize  # bytes of a token id in the drafter's search buffer
# keys of rejection acceptance's two draws, mixed into the request's seed (the token draw uses it as is)
_ACCEPT_KEY, _RESIDUAL_KEY = 0x5851F42D4C957F2D, 0x14057B7EF767814F


class Drafter(Protocol):
    """Proposes draft tokens for a batch of decoding requests."""

    def propose(self, contexts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        """For each request's whole context (prompt, observations and generated tokens), up to
        ``budgets[i]`` tokens that may follow it (an empty list: no guess)."""
        ...

    def reset(self) -> None:
        """Forget any state: the served weights changed (a model drafter resyncs here)."""
        ...


class NgramDrafter:
    """Prompt lookup: the continuation of the latest earlier occurrence of the context's last ``n`` tokens,
    for ``n`` from ``max_ngram`` down to ``min_ngram`` (a longer match is the better guess). The drafter
    keeps each running context's search buffer (its tokens as bytes, extended as the context grows),
    dropped when the context is not proposed for.

    With ``shared_tokens`` > 0, each suffix length is also looked up in the tokens the engine's requests
    generated (:class:`SharedNgrams`): those of the other running requests and of finished ones, up to
    that many remembered. The longest suffix with a match drafts, its match in the context itself first.
    A proposal then depends on what else the engine served; the emitted tokens do not (a draft only
    decides how many of them one step emits)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, shared_tokens: int = 0) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._bufs: dict[int, tuple[list[int], int, bytearray]] = {}  # id -> (context, its length, bytes)
        self.shared = SharedNgrams(max_ngram, min_ngram, shared_tokens) if shared_tokens > 0 else None
        self.shared_drafts = 0  # drafts taken from the shared n-grams, ever

    def propose(self, contexts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        bufs, out = {}, []
        for context in contexts:
            # contexts only grow (the scheduler appends to a request's tokens), so a context's buffer is
            # extended by its new tokens; the identity check keeps a reused id from reading another's
            had = self._bufs.get(id(context))
            seen = had is not None and had[0] is context and had[1] <= len(context)
            if seen:
                buf = had[2]
                buf += array("i", context[had[1] :]).tobytes()
            else:
                buf = bytearray(array("i", context).tobytes())
            if self.shared is not None:  # its tokens since the last step; one seen first, from its end
                self.shared.add(context, had[1] if seen else len(context))
            bufs[id(context)] = (context, len(context), buf)
        for context, k in zip(contexts, budgets, strict=True):
            out.append(self._one(context, bufs[id(context)][2], k))
        self._bufs = bufs
        return out

    def reset(self) -> None:
        self._bufs = {}
        if self.shared is not None:
            self.shared.clear()

    def _one(self, context: list[int], buf: bytearray, k: int) -> list[int]:
        """The draft of the longest suffix with a match: in the context itself, else (at that length) in
        the shared n-grams."""
        size = len(context)
        if k <= 0 or size < self.min_ngram:
            return []
        # The tokens as machine words, searched with rfind (a C scan, no copy per window): a hit at an
        # offset that is not a multiple of the word straddles two tokens and is skipped.
        w, top = _WORD, min(self.max_ngram, size)
        tail = tuple(context[-top:]) if self.shared is not None else ()  # the shared index's keys
        for n in range(top, self.min_ngram - 1, -1):
            suffix, end = bytes(buf[-w * n :]), len(buf) - w  # a match ends before the last token
            while n < size and (at := buf.rfind(suffix, 0, end)) >= 0:
                if at % w == 0:
                    return self._continuation(context, at // w + n, k)
                end = at + w * n - 1
            if self.shared is not None and (draft := self.shared.lookup(context, tail[top - n :], k)):
                self.shared_drafts += 1
                return draft
        return []

    @staticmethod
    def _continuation(context: list[int], start: int, k: int) -> list[int]:
        """What followed the match, read on into the draft itself where the context ends: a match that
        overlaps the suffix is a loop (of period ``len(context) - start``), and the draft continues it."""
        size, draft = len(context), []
        for i in range(start, start + k):
            draft.append(context[i] if i < size else draft[i - size])
        return draft


class SharedNgrams:
    """The tokens the engine's requests generated, indexed by n-gram for :class:`NgramDrafter`: each
    n-gram (``min_ngram`` to ``max_ngram`` tokens) maps to the latest place some request's tokens went on
    after it, and a lookup proposes what followed there. A request is indexed from where the drafter
    first saw it (the end of its prompt: what it generates, and the prompt's last n-grams, which lead
    into it), each n-gram once a token follows it; requests are remembered, the oldest dropped first, up
    to ``capacity`` indexed tokens."""

    def __init__(self, max_ngram: int, min_ngram: int, capacity: int) -> None:
        self.max_ngram, self.min_ngram, self.capacity = max_ngram, min_ngram, capacity
        self._index: dict[tuple[int, ...], tuple[list[int], int]] = {}  # n-gram -> (tokens, its end)
        # id -> (tokens, n-gram ends indexed up to, tokens counted, n-grams it set), the least recently
        # grown first
        self._held: dict[int, tuple[list[int], int, int, list[tuple[int, ...]]]] = {}
        self._size = 0

    def add(self, tokens: list[int], start: int) -> None:
        """Index ``tokens`` (a context that only grows): the n-grams ending at ``start`` and after, or
        after those indexed when it is known, that a token follows."""
        had = self._held.pop(id(tokens), None)
        if had is not None and had[0] is tokens:
            start, counted, keys = had[1], had[2], had[3]
        else:
            counted, keys = 0, []
        index, low = self._index, self.min_ngram
        for end in range(max(start, low), len(tokens)):
            top = tuple(tokens[max(end - self.max_ngram, 0) : end])
            for n in range(low, len(top) + 1):
                key = top[len(top) - n :]
                index[key] = (tokens, end)
                keys.append(key)
        grown = max(len(tokens) - start, 0)
        self._size += grown
        self._held[id(tokens)] = (tokens, max(start, len(tokens)), counted + grown, keys)
        while self._size > self.capacity and len(self._held) > 1:
            dropped, _, count, its = self._held.pop(next(iter(self._held)))
            self._size -= count
            for key in its:
                if self._index.get(key, (None,))[0] is dropped:
                    del self._index[key]

    def lookup(self, context: list[int], suffix: tuple[int, ...], k: int) -> list[int]:
        """Up to ``k`` tokens that followed ``suffix`` (the context's last tokens) where another request
        generated them; [] without such a place."""
        hit = self._index.get(suffix)
        if hit is None or hit[0] is context:
            return []
        return hit[0][hit[1] : hit[1] + k]

    def clear(self) -> None:
        self._index, self._held, self._size = {}, {}, 0


class SpeculationGate:
    """Whether the next decode step speculates. A verify step costs more than a decode step (more tokens
    through the model, every one of them sampled) and pays only where its rows emit enough tokens. The gate
    keeps a running mean of the tokens per second each kind of step emits (all its rows' tokens over its
    wall time on the device thread) and takes the faster kind, taking the other one once every
    :attr:`PROBE_EVERY` steps to look again. Where drafts rarely hit (random text) a run then pays one
    verify step in ``PROBE_EVERY``; the tokens are the same either way."""

    PROBE_EVERY = 16  # steps of the faster kind between two of the other

    def __init__(self, adaptive: bool = True) -> None:
        self.adaptive = adaptive
        self.rate = {"verify": 0.0, "decode": 0.0}  # running means of the tokens per second emitted
        self._since = {"verify": 0, "decode": 0}  # steps since the last step of each kind

    def speculate(self) -> bool:
        """Whether the next decode step verifies drafts."""
        if not self.adaptive or self.rate["verify"] == 0.0:
            return True  # nothing to weigh yet: verify once to measure
        if self.rate["decode"] == 0.0:
            return False  # decode once to measure
        faster = "verify" if self.rate["verify"] >= self.rate["decode"] else "decode"
        other = "decode" if faster == "verify" else "verify"
        return (other if self._since[other] >= self.PROBE_EVERY else faster) == "verify"

    def ran(self, kind: str, tokens: int, steps: int, seconds: float) -> None:
        """``steps`` steps of ``kind`` (verify or decode) emitted ``tokens`` tokens in ``seconds``."""
        if seconds <= 0.0 or tokens <= 0:
            return
        each = tokens / seconds
        mean = self.rate[kind]
        self.rate[kind] = each if mean == 0.0 else 0.8 * mean + 0.2 * each
        other = "decode" if kind == "verify" else "verify"
        self._since[kind] = 0
        self._since[other] += steps


def make_drafter(config: SpeculativeConfig) -> Drafter:
    """The drafter ``config`` names."""
    return NgramDrafter(config.max_ngram, config.min_ngram, config.shared_tokens)


def accepted_exact(sampled: list[int], draft: list[int]) -> int:
    """How many of the ``sampled`` tokens (one per position of ``[last, draft...]``) a request emits under
    exact acceptance: every drafted token that equals the sample at its position, then the first sample
    that differs (or the one after the whole draft)."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return n + 1


def rejection_verify(
    logits: torch.Tensor, sampling: RequestSampling, seed: int, position: int, draft: list[int]
) -> list[int]:
    """Rejection acceptance of one request's ``draft``: ``logits`` [len(draft) + 1, vocab] are the model's
    at the positions ``position, position + 1, ...`` (the first predicts the first drafted token). Drafted
    token ``d`` at position ``i`` is accepted with probability ``p_i(d)`` (``p_i`` the processed
    distribution: temperature, top-k, top-p, min-p), else position ``i`` emits a sample of ``p_i`` without
    ``d``, renormalized, and the rest is dropped; after a whole accepted draft the last position emits a
    sample of its own. Returns the emitted tokens. Draws are keyed by (seed, position), apart from the
    plain token draw's; greedy rows accept exactly the argmax."""
    if sampling.temperature == 0:
        best = logits.argmax(dim=-1).tolist()
        return best[: accepted_exact(best, draft)]
    x = logits / sampling.temperature
    if sampling.top_k > 0 or sampling.top_p < 1.0 or sampling.min_p > 0:
        rows = x.shape[0]
        x = filter_logits(
            x,
            torch.full((rows,), sampling.top_k if sampling.top_k > 0 else x.shape[-1], device=x.device),
            torch.full((rows,), sampling.top_p, device=x.device),
            torch.full((rows,), sampling.min_p, device=x.device),
        )
    probs = torch.softmax(x.float(), dim=-1)
    at = torch.arange(len(draft), device=x.device)
    drafted = probs[at, torch.tensor(draft, dtype=torch.long, device=x.device)].tolist()
    out: list[int] = []
    for i, d in enumerate(draft):
        if row_uniform(seed ^ _ACCEPT_KEY, position + i) < drafted[i]:
            out.append(d)
            continue
        residual = x[i : i + 1].clone()
        residual[0, d] = torch.finfo(residual.dtype).min  # p without d (a zero-mass token is never drawn)
        return [*out, _draw(residual, seed, position + i)]
    return [*out, _draw(x[-1:], seed, position + len(draft))]


def _draw(x: torch.Tensor, seed: int, position: int) -> int:
    """A token of the distribution of logits ``x`` [1, vocab], by rejection acceptance's own draw."""
    u = torch.tensor([row_uniform(seed ^ _RESIDUAL_KEY, position)], dtype=torch.float32, device=x.device)
    return int(inverse_cdf(x, u)[0])


__all__ = [
    "Acceptance",
    "Drafter",
    "NgramDrafter",
    "SharedNgrams",
    "SpeculationGate",
    "SpeculativeConfig",
    "accepted_exact",
    "make_drafter",
    "rejection_verify",
]
