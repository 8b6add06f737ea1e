"""The embedded engine's parts on CPU: prefix index, seeded sampling, the model runner, the schedule.

The HTTP protocol is covered by test_engine_embedded_server.py; here the pieces are driven directly:
the prefix cache's matching, in-place extension and LRU; sampling noise that depends only on (seed,
position) and follows the distribution; prefill in chunks equal to prefill in one go; a next turn reusing
its prefix with the same result as without; slots freed after aborts and retractions.
"""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import pytest
import torch

from agentrl.embedded.buckets import plan_kv_cache
from agentrl.embedded.engine import EmbeddedEngine
from agentrl.embedded.prefix_cache import PrefixCache
from agentrl.embedded.runner import ExtendBatch, ModelRunner
from agentrl.embedded.sampling import (
    RequestSampling,
    inverse_cdf,
    row_uniform,
    row_uniforms,
    sample_tokens,
    signed64,
)
from agentrl.embedded.slot_copy import copy_slots, copy_waves

# ----------------------------------------------------------------------------------- prefix cache


def test_prefix_cache_matches_longest_prefix_and_extends_past_blocks() -> None:
    pc = PrefixCache([10, 11], block=4)
    seq = list(range(100, 111))  # 11 tokens: two whole blocks + 3
    assert pc.insert(seq) == (10, 0)
    assert pc.lookup([*seq, 5, 6], max_len=100) == (10, 11)  # whole blocks, then token by token
    assert pc.lookup([*seq[:9], 1, 2, 3], max_len=100) == (10, 9)
    assert pc.lookup(seq, max_len=6) == (10, 6)  # capped (a prompt must keep one token to prefill)
    assert pc.lookup([1, 2, 3, 4, 5], max_len=100) == (None, 0)
    assert pc.lookup(seq[:3], max_len=100) == (None, 0)  # under one block


def test_prefix_cache_replaces_the_turn_it_extends_and_skips_what_it_holds() -> None:
    pc = PrefixCache([10, 11], block=4)
    turn1 = list(range(100, 110))
    assert pc.insert(turn1) == (10, 0)
    assert pc.insert(turn1[:8]) == (None, 0)  # already held
    turn2 = turn1 + list(range(200, 220))
    assert pc.insert(turn2) == (10, 10)  # same slot; its first 10 positions already hold this KV
    assert len(pc) == 1
    assert pc.lookup([*turn2, 1], max_len=100) == (10, 30)


def test_prefix_cache_evicts_least_recently_used_and_clears() -> None:
    pc = PrefixCache([0, 1], block=4)
    a, b, c = ([k] * 8 for k in (1, 2, 3))
    slot_a, _ = pc.insert(a)
    slot_b, _ = pc.insert(b)
    assert pc.lookup([*a, 9], 100)[0] == slot_a  # a is now the most recent
    slot_c, _ = pc.insert(c)
    assert slot_c == slot_b
    assert pc.lookup([*b, 9], 100) == (None, 0)
    assert pc.lookup([*a, 9], 100) == (slot_a, 8)
    pc.clear()
    assert len(pc) == 0 and pc.lookup([*a, 9], 100) == (None, 0)
    assert {pc.insert(a)[0], pc.insert(b)[0]} == {0, 1}
    assert PrefixCache([], block=4).insert(a) == (None, 0)


# ----------------------------------------------------------------------------------- sampling


def test_noise_depends_only_on_seed_and_position() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    params = [RequestSampling(temperature=1.0)] * 6
    seeds, pos = [11, 12, 13, 11, 12, 13], [5, 5, 5, 6, 6, 6]
    together, lp = sample_tokens(logits, params, seeds, pos)
    alone = [sample_tokens(logits[i : i + 1], params[:1], [seeds[i]], [pos[i]])[0][0] for i in range(6)]
    assert together == alone
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(together)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(lp, dtype=torch.float32), ref, atol=1e-6)
    u = torch.tensor([row_uniform(7, p) for p in range(20_000)])
    assert float(u.min()) > 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert row_uniform(7, 3) != row_uniform(8, 3)


def test_device_draws_equal_the_scalar_reference() -> None:
    seeds = [0, 1, 7, 2**62 + 3, 2**63 - 1, 2**63, 2**64 - 1, -5, 123456789123456789]
    positions = [0, 1, 31, 4095, 2**20 + 7]
    pairs = [(s, q) for s in seeds for q in positions]
    got = row_uniforms(
        torch.tensor([signed64(s) for s, _ in pairs]), torch.tensor([q for _, q in pairs])
    ).tolist()
    want = torch.tensor([row_uniform(s, q) for s, q in pairs], dtype=torch.float32).tolist()
    assert got == want


def test_two_level_inverse_cdf_follows_the_distribution() -> None:
    # 50 tokens in blocks of 8 (the last block padded): each token's frequency matches its probability,
    # and tokens with no mass are never drawn
    g = torch.Generator().manual_seed(1)
    probs = torch.rand(50, generator=g)
    probs[[3, 17, 49]] = 0.0
    probs /= probs.sum()
    n = 40_000
    u = row_uniforms(torch.full((n,), 11), torch.arange(n))
    for block in (8, 10):  # a padded last block, then blocks that divide the vocabulary
        toks, log_z = inverse_cdf(probs.log().repeat(n, 1), u, block=block)
        freq = torch.bincount(toks, minlength=50).float() / n
        assert torch.allclose(freq, probs, atol=0.006), (freq - probs).abs().max()
        assert freq[[3, 17, 49]].sum() == 0
        assert torch.allclose(log_z, torch.zeros(n), atol=1e-5)  # the probabilities sum to one


def test_sampling_follows_the_distribution_and_its_filters() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 8000
    logits = probs.log().repeat(n, 1)
    toks, _ = sample_tokens(logits, [RequestSampling(temperature=1.0)] * n, [7] * n, list(range(n)))
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.02), freq
    hot, _ = sample_tokens(logits[:n], [RequestSampling(temperature=2.0)] * n, [7] * n, list(range(n)))
    flat = torch.softmax(probs.log() / 2.0, -1)
    assert torch.allclose(torch.bincount(torch.tensor(hot), minlength=4).float() / n, flat, atol=0.02)
    for p in (
        RequestSampling(temperature=1.0, top_k=1),
        RequestSampling(temperature=1.0, top_p=0.2),
        RequestSampling(temperature=1.0, min_p=0.9),
        RequestSampling(temperature=0.0),
    ):
        got, _ = sample_tokens(logits[:200], [p] * 200, [3] * 200, list(range(200)))
        assert set(got) == {0}, p
    two, _ = sample_tokens(logits, [RequestSampling(temperature=1.0, top_k=2)] * n, [5] * n, list(range(n)))
    assert set(two) == {0, 1}
    mixed, _ = sample_tokens(
        logits[:4], [RequestSampling(temperature=0.0), RequestSampling(temperature=1.0)] * 2, [1] * 4, [0] * 4
    )
    assert mixed[0] == mixed[2] == 0


# ----------------------------------------------------------------------------------- runner


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_runner_prefill_in_chunks_equals_one_go_and_decode_equals_hf(tiny_hf) -> None:
    r = ModelRunner(tiny_hf, num_slots=4, context_len=128, max_batch=2)
    seq = list(range(20, 60))
    whole = r.extend(ExtendBatch([0], [seq], [0]))
    r.extend(ExtendBatch([1], [seq[:13]], [0]))
    r.extend(ExtendBatch([1], [seq[13:29]], [13]))
    parts = r.extend(ExtendBatch([1], [seq[29:]], [29]))
    assert torch.allclose(whole, parts, atol=1e-5)
    assert torch.allclose(r.k[:, 0, :, :40], r.k[:, 1, :, :40], atol=1e-5)
    with torch.no_grad():
        ref = tiny_hf(torch.tensor([[*seq, 77]])).logits[0].float()
    assert torch.allclose(whole[0], ref[-2], atol=1e-4)
    step = r.decode([77, 77], [40, 40])
    assert torch.allclose(step[0], ref[-1], atol=1e-4) and torch.allclose(step[1], ref[-1], atol=1e-4)
    # a padded batch of unequal rows gives each row its own result
    mixed = r.extend(ExtendBatch([0, 1], [seq[:5], seq], [0, 0]))
    assert torch.allclose(mixed[1], whole[0], atol=1e-5)


def test_kv_plan_shrinks_context_then_gives_up_prefix_slots() -> None:
    per_tok = 1000
    ctx, slots = plan_kv_cache(64 * 4096 * per_tok * 2, per_tok, 64, 64, 4096, None)
    assert (ctx, slots) == (4096, 64)
    ctx, slots = plan_kv_cache(64 * 4096 * per_tok, per_tok, 64, 64, 4096, None)
    assert (ctx, slots) == (2048, 64)  # the context shrinks first, down to 1,024 tokens
    ctx, slots = plan_kv_cache(64 * 512 * per_tok, per_tok, 64, 64, 4096, None)
    assert slots == 0 and ctx == 512
    with pytest.raises(ValueError, match="max_batch_size"):
        plan_kv_cache(64 * 10 * per_tok, per_tok, 64, 0, 4096, None)


# ----------------------------------------------------------------------------------- the schedule


def _greedy(n: int) -> RequestSampling:
    return RequestSampling(temperature=0.0, max_new_tokens=n, ignore_eos=True)


async def _run_all(engine: EmbeddedEngine, prompts: list[list[int]], sp: RequestSampling, tag: str):
    return await asyncio.gather(*(engine.generate(p, sp, f"{tag}{i}") for i, p in enumerate(prompts)))


async def test_chunked_prefill_and_prefix_reuse_change_nothing(tiny_model_dir: Path) -> None:
    prompts = [list(range(30 + i, 70 + 2 * i)) for i in range(6)]
    plain = EmbeddedEngine(tiny_model_dir, max_batch_size=4, prefix_cache_slots=0)
    chunked = EmbeddedEngine(tiny_model_dir, max_batch_size=4, max_prefill_tokens=16, prefix_cache_slots=8)
    a = await _run_all(plain, prompts, _greedy(12), "a")
    b = await _run_all(chunked, prompts, _greedy(12), "b")
    assert [x.output_ids for x in a] == [x.output_ids for x in b]
    for x, y in zip(a, b, strict=True):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4
    assert chunked.stats["prefill_tokens"] == sum(len(p) for p in prompts)

    # next turns: prompt + output + observation; the reusing engine prefills only what is new
    turn2 = [p + x.output_ids + [5, 6, 7, 8] for p, x in zip(prompts, a, strict=True)]
    before = dict(chunked.stats)
    a2 = await _run_all(plain, turn2, _greedy(8), "a2")
    b2 = await _run_all(chunked, turn2, _greedy(8), "b2")
    assert [x.output_ids for x in a2] == [x.output_ids for x in b2]
    computed = chunked.stats["prefill_tokens"] - before["prefill_tokens"]
    assert computed == 5 * len(turn2)  # the last output token (no KV yet) + 4 observation tokens
    assert all(x.cached_tokens == len(t) - 5 for x, t in zip(b2, turn2, strict=True))
    assert not chunked.scheduler.active and not plain.scheduler.active


async def test_aborts_and_retraction_free_every_slot(tiny_model_dir: Path) -> None:
    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=3)
    prompts = [list(range(40 + i, 60 + i)) for i in range(10)]
    long = RequestSampling(temperature=1.0, max_new_tokens=200, ignore_eos=True)
    tasks = [asyncio.create_task(engine.generate(p, long, f"r{i}")) for i, p in enumerate(prompts)]
    while engine.stats["decode_steps"] < 3:
        await asyncio.sleep(0.005)
    engine.abort("r1")
    engine.abort("r7")  # still waiting for a slot
    engine.pause("retract")
    for _ in range(2000):
        if not engine.scheduler.in_flight:
            break  # all taken out, their tokens kept
        await asyncio.sleep(0.005)
    assert not engine.scheduler.in_flight
    engine.continue_generation()
    recs = await asyncio.gather(*tasks)
    kinds = [r.finish_reason["type"] for r in recs]
    assert kinds[1] == kinds[7] == "abort"
    assert all(
        k == "length" and len(r.output_ids) == 200
        for i, (k, r) in enumerate(zip(kinds, recs, strict=False))
        if i not in (1, 7)
    )
    assert not engine.scheduler.in_flight and not engine._requests
    for r in recs:
        assert all(math.isfinite(x) and x <= 0 for x in r.logprobs)


async def test_token_stream_yields_every_token_as_sampled_and_closing_aborts(tiny_model_dir: Path) -> None:
    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=2, prefix_cache_slots=0)  # same path: same bits
    seeded = RequestSampling(temperature=1.0, max_new_tokens=30, sampling_seed=4, ignore_eos=True)
    whole = await engine.generate(list(range(40, 60)), seeded, "whole")
    stream = engine.stream(list(range(40, 60)), seeded, "streamed")
    deltas = [d async for d in stream]
    assert len(deltas) > 1 and stream.record is not None
    assert [t for d in deltas for t in d.ids] == stream.record.output_ids == whole.output_ids
    assert [x for d in deltas for x in d.logprobs] == stream.record.logprobs == whole.logprobs

    long = engine.stream(list(range(40, 60)), _greedy(2000), "long")
    first = await anext(long)
    assert first.ids and engine.num_running == 1  # the first tokens came while the request runs
    before = engine.stats["decode_steps"]
    await long.aclose()
    for _ in range(2000):
        if engine.num_running == 0:
            break
        await asyncio.sleep(0.005)
    assert engine.num_running == 0 and not engine.scheduler.in_flight
    assert engine.stats["decode_steps"] - before < 1000  # aborted, not run to its 2,000 tokens
    with pytest.raises(StopAsyncIteration):
        await anext(long)


async def test_context_limit_is_a_clear_error(tiny_model_dir: Path) -> None:
    from agentrl.embedded.sampling import EngineBadRequest

    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=2, context_len=64)
    with pytest.raises(EngineBadRequest, match="context of 64 tokens"):
        await engine.generate(list(range(60)), _greedy(10), "x")
    rec = await engine.generate(list(range(50)), _greedy(14), "y")
    assert len(rec.output_ids) == 14


async def test_stop_screening_never_hides_a_stop_string(tiny_model_dir: Path) -> None:
    """A sampled token is checked against the stop strings only if its text holds a stop's last character;
    on random token streams, every step the full check matches is also one the screen lets through,
    and most steps are screened out."""
    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=2)
    sched, tok = engine.scheduler, engine.tokenizer
    g = torch.Generator().manual_seed(0)
    checked = steps = matched = 0
    for trial in range(40):
        ids = torch.randint(3, engine.vocab_size, (40,), generator=g).tolist()
        text = tok.decode(ids, skip_special_tokens=False)
        start = int(torch.randint(0, max(1, len(text) - 4), (1,), generator=g))
        stops = [text[start : start + 3], "</answer>"]
        if not stops[0].strip():
            continue
        for k in range(1, len(ids) + 1):
            steps += 1
            may = sched._may_stop(ids[k - 1], stops)
            checked += may
            if sched._match_stop(ids[:k], stops) is not None:
                assert may, (trial, k, stops)
                matched += 1
                break
    assert matched >= 20
    assert checked < steps / 2  # the screen does skip work


def test_admission_waits_as_long_as_a_prefill_step_costs(tiny_model_dir: Path) -> None:
    sched = EmbeddedEngine(tiny_model_dir, max_batch_size=2).scheduler
    assert sched._admit_every() == sched.ADMIT_EVERY  # nothing measured yet
    sched._step_s.update(prefill=0.070, decode=0.007)
    assert sched._admit_every() == 10
    sched._step_s.update(prefill=0.010, decode=0.007)
    assert sched._admit_every() == sched.ADMIT_EVERY  # never below the floor
    sched._step_s.update(prefill=5.0, decode=0.001)
    assert sched._admit_every() == 64  # nor above the cap


async def test_a_long_row_does_not_keep_a_prefill_step_to_itself(tiny_model_dir: Path) -> None:
    """The prefill budget counts the rows' own tokens: a 40-token row and three 8-token rows (64 tokens)
    go in one step of a 64-token budget, although their padded rectangle is 4 x 40 cells."""
    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=4, max_prefill_tokens=64, prefix_cache_slots=0)
    prompts = [list(range(10, 50))] + [list(range(60 + 8 * i, 68 + 8 * i)) for i in range(3)]
    alone = [await engine.generate(p, _greedy(1), f"a{i}") for i, p in enumerate(prompts)]
    before = engine.stats["prefill_steps"]
    together = await _run_all(engine, prompts, _greedy(1), "b")
    assert engine.stats["prefill_steps"] - before == 1
    for x, y in zip(alone, together, strict=True):
        assert x.output_ids == y.output_ids
        assert abs(x.logprobs[0] - y.logprobs[0]) < 1e-4


def test_packed_prefill_layout_equals_padded_prefill_on_cpu(tiny_hf) -> None:
    """The packed prefill's layout (tokens end to end, per-token slots and positions, the attention
    blocks, each row's last token) through the kernel's torch reference: the same logits and KV cache as
    the padded SDPA prefill, for fresh rows, rows after a cached prefix and rows longer than a block."""
    packed = ModelRunner(tiny_hf, num_slots=6, context_len=512, max_batch=4)
    padded = ModelRunner(tiny_hf, num_slots=6, context_len=512, max_batch=4)
    packed.packed_prefill = True  # on a GPU by default; here through the reference
    g = torch.Generator().manual_seed(0)

    def toks(n: int) -> list[int]:
        return torch.randint(3, packed.vocab_size, (n,), generator=g).tolist()

    steps = [
        ExtendBatch([0, 1, 4], [toks(150), toks(7), toks(65)], [0, 0, 0]),
        ExtendBatch([0, 1, 4, 2], [toks(40), toks(1), toks(3), toks(70)], [150, 7, 65, 0]),
    ]
    for batch in steps:
        torch.testing.assert_close(packed.extend(batch), padded.extend(batch), atol=1e-5, rtol=1e-5)
    # a CUDA graph's bucket layout (padding tokens at slot 0's scratch column, empty blocks, last-token
    # entries for max_batch rows), run eagerly: the same logits, and the padding writes no real position
    step = ExtendBatch([2, 3], [toks(20), toks(5)], [70, 0])
    nb = packed._prefill_blocks(128)
    host, blocks = packed._packed_layout(step, 128, packed.max_batch, nb)
    assert blocks == nb and host.numel() == 3 * 128 + packed.max_batch + 4 * nb
    bucketed = packed._extend_forward(host, 128, packed.max_batch, nb)[:2]
    torch.testing.assert_close(bucketed, padded.extend(step), atol=1e-5, rtol=1e-5)
    for slot, n in ((0, 190), (1, 8), (2, 90), (3, 5), (4, 68)):
        torch.testing.assert_close(packed.k[:, slot, :, :n], padded.k[:, slot, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed.v[:, slot, :, :n], padded.v[:, slot, :, :n], atol=1e-5, rtol=1e-5)


def _random_copies(
    rng: random.Random, slots: int, positions: int, count: int
) -> list[tuple[int, int, int, int]]:
    out = []
    for _ in range(count):
        start = rng.randrange(positions)
        out.append((rng.randrange(slots), rng.randrange(slots), rng.randrange(start, positions + 1), start))
    return out


def test_slot_copy_waves_give_the_sequential_result() -> None:
    """Copies cut into waves and each wave run in reverse order, every read before any write (as one
    concurrent launch may), equal the copies run one by one in order."""
    rng = random.Random(0)
    for trial in range(200):
        k = torch.randn(2, 6, 2, 9, 4)
        copies = _random_copies(rng, 6, 9, rng.randrange(1, 12))
        if (
            trial % 2
        ):  # the scheduler's shape: a cache insert, then the last slot compacted into the freed one
            copies = [c for i in range(3) for c in ((i, 3 + i, 9, 0), (5 - i, i, 7, 0))]
        want = k.clone()
        for src, dst, n, start in copies:
            want[:, dst, :, start:n] = want[:, src, :, start:n].clone()
        got = k.clone()
        waves = copy_waves(copies)
        for wave in waves:
            reads = [got[:, src, :, start:n].clone() for src, _, n, start in wave]
            for (_, dst, n, start), block in reversed(list(zip(wave, reads, strict=True))):
                got[:, dst, :, start:n] = block
        assert torch.equal(got, want), (trial, copies, waves)
        assert sum(len(w) for w in waves) == sum(1 for s, d, n, st in copies if n > st and s != d)
    v = torch.randn(2, 6, 2, 9, 4)
    ref_k, ref_v = k.clone(), v.clone()
    for src, dst, n, start in copies:
        ref_k[:, dst, :, start:n] = ref_k[:, src, :, start:n].clone()
        ref_v[:, dst, :, start:n] = ref_v[:, src, :, start:n].clone()
    assert copy_slots(k, v, copies) == 0  # CPU: one by one, in order
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


def test_pack_parameters_puts_every_weight_in_one_aligned_buffer(tiny_hf) -> None:
    """The engine's weights are views of one buffer (one region to release and resume), tied weights
    once, each at an aligned offset, with their values and the model's outputs unchanged."""
    from agentrl.embedded.weights import pack_parameters
    from agentrl.storage_offload import unique_storages

    model = tiny_hf
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        before = model(ids).logits.clone()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    flat = pack_parameters(model, torch.device("cpu"))
    storages = unique_storages(model.parameters())
    assert len(storages) == 1 and storages[0].data_ptr() == flat.untyped_storage().data_ptr()
    assert all((p.data_ptr() - flat.data_ptr()) % 256 == 0 for p in model.parameters())
    assert all(torch.equal(p, values[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


async def test_decode_runs_give_the_tokens_of_single_steps(tiny_model_dir: Path) -> None:
    """Decode steps run back to back on the device thread (Scheduler.DECODE_RUN) give every request the
    tokens, logprobs and finish reasons of one step per event-loop turn: rows finishing at different
    steps (stop ids, stop strings, lengths), seeded sampling, and requests arriving mid-run."""
    prompts = [list(range(20 + 3 * i, 40 + 5 * i)) for i in range(6)]
    lengths_of = (3, 17, 9, 30, 1, 22)
    probe = EmbeddedEngine(tiny_model_dir, max_batch_size=4, seed=0)
    free = [
        await probe.generate(
            p, RequestSampling(max_new_tokens=30, sampling_seed=100 + i, ignore_eos=True), f"p{i}"
        )
        for i, p in enumerate(prompts)
    ]  # a seeded draw depends on nothing but (seed, position): stops taken from here are met in the runs
    stop_id, stop_text = free[1].output_ids[6], probe.tokenizer.decode(free[3].output_ids[4:6])
    params = [
        RequestSampling(max_new_tokens=n, sampling_seed=100 + i, stop=[stop_text], stop_token_ids=[stop_id])
        for i, n in enumerate(lengths_of)
    ]

    async def run(decode_run: int) -> tuple[list, int]:
        engine = EmbeddedEngine(tiny_model_dir, max_batch_size=4, seed=0)
        engine.scheduler.DECODE_RUN = decode_run
        inner, lengths = engine.scheduler._decode_run, []

        def spy(rows):
            out = inner(rows)
            lengths.append((len(rows), out[2]))  # a run stops at a finishing row: every row takes every step
            return out

        engine.scheduler._decode_run = spy
        first = [
            engine.generate(p, sp, f"r{i}")
            for i, (p, sp) in enumerate(zip(prompts[:4], params[:4], strict=True))
        ]
        tasks = [asyncio.ensure_future(c) for c in first]
        await asyncio.sleep(0.05)  # the last two arrive while the first four decode
        tasks += [
            asyncio.ensure_future(engine.generate(p, sp, f"l{i}"))
            for i, (p, sp) in enumerate(zip(prompts[4:], params[4:], strict=True))
        ]
        recs = await asyncio.gather(*tasks)
        return [(r.output_ids, r.logprobs, r.finish_reason) for r in recs], lengths

    single, lengths_single = await run(1)
    runs, lengths_runs = await run(8)
    assert [x[0] for x in runs] == [x[0] for x in single]
    assert [x[2] for x in runs] == [x[2] for x in single]
    for (_, a, _), (_, b, _) in zip(runs, single, strict=True):
        assert max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0) < 1e-5
    assert {x[2]["type"] for x in single} == {"length", "stop"}
    steps_single, steps_runs = [n for _, n in lengths_single], [n for _, n in lengths_runs]
    assert set(steps_single) == {1} and max(steps_runs) == 8  # runs were taken, and cut short
    assert len(lengths_runs) < len(lengths_single) / 2
    # every decoded token once, whichever steps the late arrivals joined (that depends on timing): the
    # first token of each request comes from its prefill
    decoded = sum(len(ids) - 1 for ids, _, _ in single)
    assert sum(r * n for r, n in lengths_runs) == sum(r * n for r, n in lengths_single) == decoded
