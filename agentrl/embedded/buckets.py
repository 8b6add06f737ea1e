"""The shapes the embedded engine's model runner is captured at and its KV cache is planned for.

A decode step pads its rows to a batch bucket and its attention to a length bucket, and each (batch,
length) pair is one captured CUDA graph; packed prefill steps and speculative verify steps pad their
tokens to a token bucket, one graph each. :func:`plan_kv_cache` sizes the static KV cache: the context
length every running sequence gets and the slots kept for prefix reuse, within a memory budget.
"""

from __future__ import annotations

# Packed prefill steps of up to this many tokens replay a captured graph; larger ones run eagerly (their
# GPU work covers the launches, and a graph's activations stay in the graph pool while the engine sleeps)
PREFILL_GRAPH_TOKENS = 8192
# Speculative verify steps (logits at every token) of up to this many tokens replay a captured graph: a
# verify step is a decode step's work over a few tokens a row, as launch-bound as one
VERIFY_GRAPH_TOKENS = 1024


def bucket_of(x: int, buckets: list[int]) -> int:
    """The smallest of ``buckets`` (ascending) that holds ``x``."""
    for b in buckets:
        if b >= x:
            return b
    raise ValueError(f"{x} is over the largest bucket {buckets[-1]}")


def batch_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes with a captured graph: 1, 2, 4, 8, then steps of 8 to 64, of 32 beyond."""
    out = [b for b in (1, 2, 4) if b < max_batch]
    b = 8
    while b < max_batch:
        out.append(b)
        b += 8 if b < 64 else 32
    return [*out, max_batch]


def length_buckets(context_len: int, smallest: int = 128) -> list[int]:
    """Attention lengths of decode steps: powers of two from ``smallest``, and ``context_len`` itself."""
    out, b = [], smallest
    while b < context_len:
        out.append(b)
        b *= 2
    return [*out, context_len]


def prefill_buckets() -> list[int]:
    """Token counts of the packed prefill steps with a captured graph: powers of two from 64 to
    :data:`PREFILL_GRAPH_TOKENS`."""
    out, b = [], 64
    while b <= PREFILL_GRAPH_TOKENS:
        out.append(b)
        b *= 2
    return out


def plan_kv_cache(
    budget: int, per_token: int, max_batch: int, cache_slots: int, model_context: int, context_len: int | None
) -> tuple[int, int]:
    """(context_len, cache_slots) that fit ``budget`` bytes of KV cache. Without an explicit context length,
    running sequences get the model's context (up to 8,192) if it fits beside the prefix-cache slots; else
    the context shrinks, down to 1,024 tokens, and only then are prefix-cache slots given up."""
    if context_len is None:
        want = min(model_context, 8192)
        context_len = budget // ((max_batch + cache_slots) * per_token)
        if context_len < want:
            fit = max(0, budget // (min(want, 1024) * per_token) - max_batch)
            cache_slots = min(cache_slots, fit)
            context_len = budget // ((max_batch + cache_slots) * per_token)
        context_len = min(context_len, want)
    context_len = min(int(context_len), model_context) // 16 * 16
    if context_len < 64:
        raise ValueError(
            f"a KV cache of {budget / 2**30:.2f} GiB holds only {context_len} tokens for each of "
            f"{max_batch} sequences: lower max_batch_size or give the engine more memory (mem_fraction)"
        )
    return context_len, cache_slots


__all__ = [
    "PREFILL_GRAPH_TOKENS",
    "VERIFY_GRAPH_TOKENS",
    "batch_buckets",
    "bucket_of",
    "length_buckets",
    "plan_kv_cache",
    "prefill_buckets",
]
