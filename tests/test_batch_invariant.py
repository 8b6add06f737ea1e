"""Batch invariance on CPU (fp32): the ops of :mod:`agentrl.batch_invariant` give a row the same bits
whatever else is in the call, and the embedded engine in batch-invariant mode gives a request the same
tokens and logprobs alone or among 255 others, at any batch position, with or without prefix reuse,
whatever the prefill chunking."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import torch

from agentrl import batch_invariant as bi
from agentrl.embedded.engine import EmbeddedEngine
from agentrl.embedded.sampling import RequestSampling


def test_row_ops_do_not_depend_on_the_other_rows() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 96, generator=g)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g)
    full = bi.linear(x, w, b)
    norm = bi.rms_norm(x, w[0, :96], 1e-6)
    lse = bi.logsumexp(full)
    for m in (1, 2, 3, 5, 7, 11, 12, 17, 64, 255):
        assert torch.equal(bi.linear(x[:m], w, b), full[:m]), m
        assert torch.equal(bi.rms_norm(x[:m], w[0, :96], 1e-6), norm[:m]), m
        assert torch.equal(bi.logsumexp(full[:m]), lse[:m]), m
    for p in (1, 9, 100):  # row 0 moved to position p
        moved = torch.cat([x[1 : p + 1], x[:1], x[p + 1 :]])
        assert torch.equal(bi.linear(moved, w, b)[p], full[0])
    # one output column block of a wider weight: the same dot products
    assert torch.equal(bi.linear(x, torch.cat([w, w[:50]]))[:, :200], bi.linear(x, w))


def test_attention_is_the_same_for_a_whole_sequence_decode_and_prefill_chunks() -> None:
    g = torch.Generator().manual_seed(1)
    n, heads, kv, d = 150, 4, 2, 16
    q = torch.randn(1, n, heads, d, generator=g)
    k = torch.randn(1, kv, n, d, generator=g)
    v = torch.randn(1, kv, n, d, generator=g)
    whole = bi.attention(q, k, v, torch.arange(n)[None], 0.25)  # a trainer's forward
    cache_k = torch.zeros(3, kv, 512, d)  # a KV cache: slot 2, padded far past the sequence
    cache_v = torch.zeros(3, kv, 512, d)
    cache_k[2, :, :n], cache_v[2, :, :n] = k[0], v[0]
    slot = torch.tensor([2])
    for t in (0, 1, 63, 64, 65, 128, 149):  # decode: one query over a bucket of 256 or all 512 keys
        for length in (256, 512):
            one = bi.attention(
                q[:, t : t + 1],
                cache_k[:, :, :length],
                cache_v[:, :, :length],
                torch.tensor([[t]]),
                0.25,
                slot,
            )
            assert torch.equal(one[0, 0], whole[0, t]), (t, length)
    for width in (1, 37, 64, 100):  # prefill in chunks of `width` queries over the keys cached so far
        parts = []
        for s in range(0, n, width):
            e = min(n, s + width)
            parts.append(
                bi.attention(
                    q[:, s:e], cache_k[:, :, :e], cache_v[:, :, :e], torch.arange(s, e)[None], 0.25, slot
                )
            )
        assert torch.equal(torch.cat(parts, 1), whole), width


def test_attention_row_ignores_the_batch_and_stale_keys_past_its_position() -> None:
    """A reused cache slot holds stale keys past a sequence's position, a call holds rows at other
    positions and slots, a prefill chunk spans several query blocks: a row's bits stay its own."""
    g = torch.Generator().manual_seed(2)
    heads, kv, d, slots = 4, 2, 16, 6
    cache_k = torch.randn(slots, kv, 300, d, generator=g)  # stale keys everywhere past each row
    cache_v = torch.randn(slots, kv, 300, d, generator=g)
    q = torch.randn(slots, 1, heads, d, generator=g)
    pos = torch.tensor([[5], [0], [130], [299], [64], [63]])
    crowd = bi.attention(q, cache_k, cache_v, pos, 0.25)  # decode: one query per row, the whole cache
    for r in range(slots):
        t = int(pos[r, 0]) + 1  # alone, with exactly its keys (zero-padded to a key chunk)
        alone = bi.attention(
            q[r : r + 1], cache_k[r : r + 1, :, :t], cache_v[r : r + 1, :, :t], pos[r : r + 1], 0.25
        )
        assert torch.equal(crowd[r], alone[0]), r
    w, order = 150, torch.tensor([4, 0, 2])  # prefill after cached prefixes of 0, 40 and 140 tokens
    qs = torch.randn(3, w, heads, d, generator=g)
    qpos = torch.tensor([0, 40, 140])[:, None] + torch.arange(w)[None]
    qpos[2, 120:] = 0  # right padding: queries past the row's tokens read key 0 only
    both = bi.attention(qs, cache_k, cache_v, qpos, 0.25, order)
    for r in range(3):
        slot = order[r : r + 1]
        alone = bi.attention(qs[r : r + 1], cache_k, cache_v, qpos[r : r + 1], 0.25, slot)
        assert torch.equal(both[r], alone[0]), r
        for j in (0, 1, 63, 64, 65, 119, 149):  # the same query decoded on its own
            one = bi.attention(
                qs[r : r + 1, j : j + 1], cache_k, cache_v, qpos[r : r + 1, j : j + 1], 0.25, slot
            )
            assert torch.equal(one[0, 0], alone[0, j]), (r, j)


def _engine(model: Path, **kw) -> EmbeddedEngine:
    return EmbeddedEngine(model, max_batch_size=256, batch_invariant=True, **kw)


async def test_engine_request_bits_alone_among_255_at_any_position_with_reuse_and_chunking(
    tiny_model_dir: Path,
) -> None:
    rng = random.Random(0)
    mine = [rng.randrange(3, 200) for _ in range(70)]
    others = [[rng.randrange(3, 200) for _ in range(rng.randrange(5, 90))] for _ in range(255)]

    def seeded(p: list[int], seed: int) -> RequestSampling:
        return RequestSampling(temperature=1.0, max_new_tokens=12, sampling_seed=seed, ignore_eos=True)

    alone_engine = _engine(tiny_model_dir, prefix_cache_slots=0)
    alone = await alone_engine.generate(mine, seeded(mine, 7), "alone")
    alone_engine.shutdown()

    def check(rec) -> None:
        assert rec.output_ids == alone.output_ids
        assert rec.logprobs == alone.logprobs  # exact floats

    crowd = _engine(tiny_model_dir, prefix_cache_slots=0)
    for pos in (0, 100, 255):  # its batch position (slot) among 255 others
        batch = [*others[:pos], mine, *others[pos:]]
        recs = await asyncio.gather(
            *(
                crowd.generate(p, seeded(p, 7 if p is mine else 1000 + i), f"c{pos}-{i}")
                for i, p in enumerate(batch)
            )
        )
        check(recs[pos])
    crowd.shutdown()

    # chunked prefill (16 tokens a step) and prefix reuse: the first 48 tokens come from the cache
    reuse = _engine(tiny_model_dir, prefix_cache_slots=8, max_prefill_tokens=16)
    await reuse.generate([*mine[:48], 5, 6, 7], seeded(mine, 3), "prefix")
    batch = [*others[:40], mine]
    recs = await asyncio.gather(
        *(reuse.generate(p, seeded(p, 7 if p is mine else 1000 + i), f"r{i}") for i, p in enumerate(batch))
    )
    assert recs[-1].cached_tokens >= 48
    check(recs[-1])
    reuse.shutdown()


def test_compiled_warmup_writes_only_running_slots(tiny_model_dir: Path) -> None:
    """The warm-up of a compiled engine (a GPU's path, run here on CPU) prefilled two rows: with one
    running slot and no prefix cache the second was past the KV cache, an IndexError on CPU and the
    device-side assert that ended deterministic runs on a GPU."""
    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=1, prefix_cache_slots=0)
    try:
        assert engine.runner.num_slots == 1
        engine.runner.compiled = True  # warm up as a compiled engine does
        engine.warmup(64)
    finally:
        engine.shutdown()
