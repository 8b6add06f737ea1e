"""Speculative decoding in the embedded engine (agentrl.embedded.speculative) changes no token.

With exact acceptance every request gets the tokens, logprobs and finish reasons it gets without
speculation, bit for bit in batch-invariant mode, at temperature 0 and 1: over multi-turn-like prompts
whose repetition makes drafts hit, with stop strings met inside an accepted draft, lengths reached in a
verify step, an abort mid-request, a retraction and a weight update between requests. Rejection
acceptance keeps the target distribution (a statistical test of one position over many draws).
"""

from __future__ import annotations

import asyncio
import math
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_deterministic import PLAIN_RUN_GROUP

from agentrl.embedded.engine import EmbeddedEngine
from agentrl.embedded.sampling import RequestSampling
from agentrl.embedded.speculative import (
    NgramDrafter,
    SharedNgrams,
    SpeculationGate,
    SpeculativeConfig,
    accepted_exact,
    rejection_verify,
)

SPEC = SpeculativeConfig(num_draft_tokens=4, max_ngram=3, min_ngram=1, adaptive=False)


@pytest.fixture(scope="module")
def peaked_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its logits scaled up (final norm x6): at temperature 1 its samples repeat
    themselves, as a trained model's copies from its context do, so drafts hit."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("peaked")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    model.save_pretrained(out)
    return out


def _prompts() -> list[list[int]]:
    """Multi-turn-like prompts: a passage, a question that repeats part of it, an observation that
    repeats it again."""
    out = []
    for i in range(5):
        passage = [(7 * i + 3 * j) % 97 + 10 for j in range(24)]
        out.append([1, 2, *passage, 3, *passage[5:15], 4, 5, *passage[2:20], 6])
    return out


# ----------------------------------------------------------------------------------- the parts
def test_ngram_drafter_proposes_what_followed_the_latest_longest_match() -> None:
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    ctx = [1, 2, 3, 9, 1, 2, 3, 4, 5, 8, 2, 3]
    assert d.propose([ctx], [3]) == [[4, 5, 8]]  # [1,2,3]? no: the suffix is [8,2,3]; [2,3] last at 5
    assert d.propose([[5, 6, 7]], [4]) == [[]]  # nothing earlier matches
    assert d.propose([[7, 7, 7, 7]], [3]) == [[7, 7, 7]]  # a loop goes on into the draft
    assert d.propose([[3, 4, 3, 4, 3]], [5]) == [[4, 3, 4, 3, 4]]
    assert d.propose([ctx], [0]) == [[]]
    assert NgramDrafter(3, 3).propose([[1, 2, 9, 2]], [2]) == [[]]  # the 1-gram match is below min_ngram
    grow = [5, 1, 2, 8]  # a running request's tokens, appended to between steps
    for t in (1, 2, 6, 1, 2):
        grow.append(t)
        assert d.propose([grow], [3]) == NgramDrafter(3, 1).propose([list(grow)], [3])
    d.reset()
    assert accepted_exact([4, 5, 6], [4, 5]) == 3 and accepted_exact([4, 9, 6], [4, 5]) == 2
    assert accepted_exact([7], []) == 1
    with pytest.raises(ValueError, match="min_ngram"):
        SpeculativeConfig(max_ngram=2, min_ngram=3)


def test_shared_ngrams_draft_from_what_other_requests_generated() -> None:
    """``shared_tokens``: a request drafts what another request generated after the same suffix (a
    running one's or a finished one's); the longest suffix with a match wins, its own match first at one
    length; a prompt is not indexed, only its last n-grams that lead into what it generates; the oldest
    requests go first when the remembered tokens pass the capacity; a reset forgets them."""
    d = NgramDrafter(max_ngram=3, min_ngram=2, shared_tokens=1000)
    first = [50, 51, 52, 60]  # a prompt, seen first here: only its last n-grams are indexed
    d.propose([first], [4])
    first += [61, 62, 70, 71, 72, 73]  # what it generated meanwhile
    other = [90, 91, 70, 71]  # another request with the same two tokens at its end
    assert d.propose([first, other], [4, 3]) == [[], [72, 73]]
    assert d.shared_drafts == 1
    assert NgramDrafter(3, 2).propose([list(other)], [3]) == [[]]  # on its own context alone: nothing
    sibling = [50, 51, 52, 60]  # the same prompt: drafts what the first generated after it
    assert d.propose([sibling], [3]) == [[61, 62, 70]]
    own = [70, 71, 5, 6, 70, 71]  # its own earlier [70, 71] comes first
    assert d.propose([own], [2]) == [[5, 6]]
    assert d.propose([[3, 51, 52]], [4]) == [[]]  # the prompt's inside is not indexed
    d.reset()
    assert d.propose([[90, 91, 70, 71]], [3]) == [[]]

    longer = NgramDrafter(max_ngram=3, min_ngram=2, shared_tokens=1000)
    gen = [40, 41]
    longer.propose([gen], [2])
    gen += [1, 2, 3, 8, 9]
    mine = [2, 3, 5, 6, 1, 2, 3]  # its own [2, 3] is shorter than the shared [1, 2, 3]
    assert longer.propose([gen, mine], [2, 2]) == [[], [8, 9]]

    shared = SharedNgrams(max_ngram=2, min_ngram=2, capacity=6)
    a, b = [1, 2, 3, 4], [7, 8, 9]
    shared.add(a, 0)  # n-gram ends 2..4 of a
    assert shared.lookup([9, 2, 3], (2, 3), 2) == [4]
    a.append(5)
    shared.add(a, 0)  # known: indexed on from where it was, not again from 0
    shared.add(b, 0)  # past the capacity: a, the oldest, is forgotten
    assert shared.lookup([9, 2, 3], (2, 3), 2) == [] and shared.lookup([0, 7, 8], (7, 8), 2) == [9]


def test_rejection_acceptance_keeps_the_target_distribution() -> None:
    """Many draws of one position with a drafted token of probability 0.3 (accepted about 30% of the
    time): the emitted token's frequencies are the target's (total variation and chi-square), with and
    without a top-k filter."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0] * 6])
    n = 6000
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: a thread team's wake-ups would cost more than they do
    try:
        _draws(logits, n)
    finally:
        torch.set_num_threads(threads)


def _draws(logits: torch.Tensor, n: int) -> None:
    for top_k, draft in ((-1, 1), (3, 5)):
        sp = RequestSampling(temperature=1.0, top_k=top_k)
        x = logits[0].clone()
        if top_k > 0:
            x[x < x.topk(top_k).values[-1]] = -math.inf
        p = torch.softmax(x, dim=-1)
        counts = torch.zeros(6)
        accepted = 0
        for seed in range(n):
            toks = rejection_verify(logits, sp, seed, 40, [draft])
            counts[toks[0]] += 1
            accepted += len(toks) == 2
        freq = counts / n
        assert 0.5 * float((freq - p).abs().sum()) < 0.03, (top_k, freq, p)
        keep = p > 0
        chi2 = float((((counts - n * p) ** 2)[keep] / (n * p[keep])).sum())
        assert chi2 < 25.0, chi2  # 5 degrees of freedom at most: p-value ~1e-4
        assert abs(accepted / n - float(p[draft])) < 0.03
        assert counts[~keep].sum() == 0  # a filtered-out token is never emitted


def test_the_gate_speculates_only_while_it_pays() -> None:
    """The adaptive gate verifies first (nothing measured), then decodes once to measure a decode step;
    afterwards it takes the kind of step that emitted more tokens per second, and the other kind once
    every PROBE_EVERY steps to look again."""
    gate = SpeculationGate(adaptive=True)
    assert gate.speculate()
    gate.ran("verify", tokens=12, steps=1, seconds=0.003)  # 10 rows, 1.2 tokens a row: 4,000 tokens/s
    assert not gate.speculate()  # no decode step measured yet
    gate.ran("decode", tokens=80, steps=8, seconds=0.016)  # 10 rows x 8 steps: 5,000 tokens/s
    for _ in range(SpeculationGate.PROBE_EVERY - 8):
        assert not gate.speculate()
        gate.ran("decode", tokens=10, steps=1, seconds=0.002)
    assert gate.speculate()  # a probe, PROBE_EVERY decode steps after the last verify step
    gate.ran("verify", tokens=40, steps=1, seconds=0.003)  # drafts started to hit: 4 tokens a row
    assert gate.rate["verify"] > gate.rate["decode"]
    for _ in range(SpeculationGate.PROBE_EVERY - 1):  # the probe was the first of them
        assert gate.speculate()
        gate.ran("verify", tokens=40, steps=1, seconds=0.003)
    assert not gate.speculate()  # a decode probe
    fixed = SpeculationGate(adaptive=False)
    fixed.ran("verify", tokens=1, steps=1, seconds=1.0)
    fixed.ran("decode", tokens=1000, steps=1, seconds=0.001)
    assert fixed.speculate()


def test_the_switch_reaches_the_embedded_server() -> None:
    """``engine.speculative`` of a run becomes the embedded server's flags, which give back the same
    config; a run with SGLang engines is told to use engine.sglang's flags."""
    from agentrl.config import ConfigError
    from agentrl.embedded.server import _parse_args, _speculative
    from agentrl.placement import engine_starter
    from agentrl.recipe import load_run_config

    run = ["model_path=/m", "data.path=/d", "env.name=math"]
    spec = [
        "engine.speculative.num_draft_tokens=6",
        "engine.speculative.max_ngram=4",
        "engine.speculative.shared_tokens=5000",
    ]
    cfg = load_run_config(None, [*run, *spec])
    extra = engine_starter(cfg, "/m", 0).keywords["extra_args"]
    assert _speculative(_parse_args(["--model", "/m", *extra])) == cfg.engine.speculative
    assert cfg.engine.speculative.num_draft_tokens == 6 and cfg.engine.speculative.min_ngram == 2
    assert "--speculative" not in engine_starter(load_run_config(None, run), "/m", 0).keywords["extra_args"]
    assert _speculative(_parse_args(["--model", "/m"])) is None
    with pytest.raises((ConfigError, ValueError), match=r"engine\.sglang"):
        load_run_config(None, [*run, *spec, "engine.backend=sglang"])

    # SGLang's own (NGRAM, no draft model) passes through engine.sglang.extra_args
    from agentrl.engine.launcher import SGLangConfig, SGLangLauncher

    sg = load_run_config(None, [*run, "engine.backend=sglang"])
    ngram = {"speculative-algorithm": "NGRAM", "speculative-num-draft-tokens": 8}
    sg.engine.sglang = SGLangConfig(model_path="/m", extra_args=ngram)
    argv = SGLangLauncher(engine_starter(sg, "/m", 0).args[0]).command()
    assert " --speculative-algorithm NGRAM --speculative-num-draft-tokens 8" in " ".join(argv)


def test_deterministic_refuses_sglang_speculation() -> None:
    """SGLang's verify step repeats no tokens (greedy flips with the draft's shapes, measured on a GPU), so
    a deterministic run with ``--speculative-algorithm`` in engine.sglang.extra_args is refused at load,
    naming the field; without deterministic it loads."""
    from agentrl.config import ConfigError
    from agentrl.recipe import load_run_config

    run = ["model_path=/m", "data.path=/d", "env.name=math", "engine.backend=sglang"]
    for key in ("speculative-algorithm", "speculative_algorithm", "--speculative-algorithm"):
        spec = f"engine.sglang={{extra_args: {{{key}: NGRAM}}}}"
        with pytest.raises(ConfigError, match=r"engine\.sglang\.extra_args: speculative-algorithm"):
            load_run_config(None, [*run, spec, "deterministic=true"])
        assert load_run_config(None, [*run, spec]).engine.sglang.extra_args == {key: "NGRAM"}
    load_run_config(None, [*run, "engine.sglang={extra_args: {cuda-graph-max-bs: 8}}", "deterministic=true"])


# ----------------------------------------------------------------------------------- the engine
async def _run(engine: EmbeddedEngine, params: list[RequestSampling], tag: str) -> list:
    prompts = _prompts()
    return await asyncio.gather(
        *(engine.generate(p, sp, f"{tag}{i}") for i, (p, sp) in enumerate(zip(prompts, params, strict=True)))
    )


def _params(temperature: float, stop: list[str] | None = None, lengths=(40, 40, 40, 7, 40)) -> list:
    return [
        RequestSampling(
            temperature=temperature,
            max_new_tokens=n,
            sampling_seed=100 + i,
            ignore_eos=True,
            stop=list(stop or []) if i == 2 else [],
        )
        for i, n in enumerate(lengths)
    ]


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        assert x.logprobs == y.logprobs  # exact floats
        assert x.finish_reason == y.finish_reason


def _stop_inside_a_step(tok, out: list[int], emitted: list, rid: str) -> tuple[str, int]:
    """A stop string that ``out`` first completes at a token that a verify step of ``rid`` emitted before
    its last one, and that token's index."""

    def first_completion(stop: str) -> int:
        return next(g for g in range(len(out)) if stop in tok.decode(out[: g + 1]))

    for rid_, start, toks in emitted:
        for at in range(start, start + len(toks) - 1) if rid_ == rid else ():
            for w in (1, 2, 3):
                stop = tok.decode(out[max(0, at - w + 1) : at + 1])
                if stop.strip() and first_completion(stop) == at:
                    return stop, at
    raise AssertionError("no stop string is first met inside a verify step")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_speculation_changes_no_token_or_logprob(peaked_model_dir: Path, temperature: float) -> None:
    plain = EmbeddedEngine(peaked_model_dir, max_batch_size=4, batch_invariant=True)
    spec = EmbeddedEngine(peaked_model_dir, max_batch_size=4, batch_invariant=True, speculative=SPEC)
    try:
        base = await _run(plain, _params(temperature), "a")
        # a stop string out of request 2's own output, met where a verify step emits several tokens
        emitted: list[tuple[str, int, list[int]]] = []
        inner = spec.scheduler._take_verified  # every verify step's tokens, within a run or after it

        def spy(rows, drafts, ids, lps):
            emitted.extend((r.rid, len(r.output_ids), list(t)) for r, t in zip(rows, ids, strict=True))
            return inner(rows, drafts, ids, lps)

        spec.scheduler._take_verified = spy
        await _run(spec, _params(temperature), "probe")
        stop, at = _stop_inside_a_step(plain.tokenizer, base[2].output_ids, emitted, "probe2")

        base = await _run(plain, _params(temperature, [stop]), "b")
        emitted.clear()
        before = dict(spec.stats)
        ours = await _run(spec, _params(temperature, [stop]), "s")
        _same(ours, base)
        assert base[2].finish_reason == {"type": "stop", "matched": stop}
        assert len(base[2].output_ids) == at + 1
        start, last = [(s, t) for rid, s, t in emitted if rid == "s2"][-1]
        assert start <= at < start + len(last) - 1  # the stop was met before the step's last token
        assert base[3].finish_reason["type"] == "length" and len(base[3].output_ids) == 7
        accepted = spec.stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        assert accepted >= 20, spec.stats  # drafts hit: many tokens came from verify steps
        assert spec.stats["spec_draft_tokens"] >= spec.stats["spec_accepted_tokens"]
        assert not spec.scheduler.active and not spec.scheduler.in_flight
    finally:
        plain.shutdown()
        spec.shutdown()


async def test_abort_retraction_and_weight_update_with_speculation(
    peaked_model_dir: Path, tiny_model_dir: Path
) -> None:
    """An aborted request answers a prefix of its tokens; a retracted one resumes to the same tokens; after
    a weight update (another model's weights) requests get the new model's tokens, stamped with the new
    version, and the freed slots serve on."""
    plain = EmbeddedEngine(peaked_model_dir, max_batch_size=4, batch_invariant=True)
    spec = EmbeddedEngine(peaked_model_dir, max_batch_size=4, batch_invariant=True, speculative=SPEC)
    other = EmbeddedEngine(tiny_model_dir, max_batch_size=4, batch_invariant=True)
    try:
        long = [
            RequestSampling(temperature=1.0, max_new_tokens=120, sampling_seed=7 + i, ignore_eos=True)
            for i in range(5)
        ]
        base = await _run(plain, long, "a")
        tasks = [
            asyncio.ensure_future(spec.generate(p, sp, f"s{i}"))
            for i, (p, sp) in enumerate(zip(_prompts(), long, strict=True))
        ]
        while spec.stats["spec_verify_steps"] < 3:
            await asyncio.sleep(0.002)
        spec.abort("s1")
        spec.pause("retract")
        while spec.scheduler.in_flight:
            await asyncio.sleep(0.002)
        spec.continue_generation()
        ours = await asyncio.gather(*tasks)
        assert ours[1].finish_reason["type"] == "abort"
        n = len(ours[1].output_ids)
        assert n < 120 and ours[1].output_ids == base[1].output_ids[:n]
        assert ours[1].logprobs == base[1].logprobs[:n]
        _same([ours[0], *ours[2:]], [base[0], *base[2:]])
        assert not spec.scheduler.active and not spec._requests

        await spec.update_weights_from_disk(str(tiny_model_dir), weight_version="2", abort_all=False)
        after = await _run(spec, _params(1.0), "u")
        want = await _run(other, _params(1.0), "o")
        _same(after, want)
        assert {r.weight_version for r in after} == {"2"}
        assert spec.stats["spec_accepted_tokens"] > 0
    finally:
        plain.shutdown()
        spec.shutdown()
        other.shutdown()


async def test_drafts_from_other_requests_change_no_token(peaked_model_dir: Path) -> None:
    """``shared_tokens``: a group's samples of one prompt, arriving one after another as a rollout's turns
    do, draft from what the earlier ones generated (greedy ones agree, as a converged policy's do; sampled
    ones mostly do not); the tokens and logprobs are those of the engine without speculation, bit for
    bit, and the shared drafts are counted and accepted."""
    prompt = _prompts()[0]
    group = [
        RequestSampling(temperature=t, max_new_tokens=48, sampling_seed=300 + i, ignore_eos=True)
        for i, t in enumerate([0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    ]
    shared = SpeculativeConfig(
        num_draft_tokens=4, max_ngram=3, min_ngram=2, adaptive=False, shared_tokens=10_000
    )
    plain = EmbeddedEngine(peaked_model_dir, max_batch_size=4, batch_invariant=True)
    spec = EmbeddedEngine(peaked_model_dir, max_batch_size=4, batch_invariant=True, speculative=shared)
    try:
        for engine in (plain, spec):
            first = await asyncio.gather(
                *(engine.generate(prompt, sp, f"a{i}") for i, sp in enumerate(group[:2]))
            )
            rest = await asyncio.gather(
                *(engine.generate(prompt, sp, f"b{i}") for i, sp in enumerate(group[2:]))
            )
            if engine is plain:
                base = [*first, *rest]
        _same([*first, *rest], base)
        assert spec.stats["spec_shared_drafts"] > 0 and spec.stats["spec_accepted_tokens"] > 0, spec.stats
    finally:
        plain.shutdown()
        spec.shutdown()


@pytest.mark.parametrize("stop", [False, True])
async def test_verify_steps_run_back_to_back_on_the_device_thread(peaked_model_dir: Path, stop: bool) -> None:
    """Like decode steps, verify steps run several to a return to the event loop (each return costs two
    thread hand-offs and the loop's turn): the device thread takes a step's tokens and proposes the next
    drafts itself while no row can finish and nothing else is due (all five requests fit the batch, so
    none waits to be admitted). With ``stop``, every request has a stop string that ends in the outputs'
    commonest character and never completes: a token holding that character may end a stop string, and
    the run goes on past it because none does. The tokens are the plain engine's."""
    config = SpeculativeConfig(num_draft_tokens=3, max_ngram=2, min_ngram=1, adaptive=False)
    plain = EmbeddedEngine(peaked_model_dir, max_batch_size=8, batch_invariant=True)
    spec = EmbeddedEngine(peaked_model_dir, max_batch_size=8, batch_invariant=True, speculative=config)
    runs: list[int] = []
    sched = spec.scheduler
    inner = sched._execute

    def counting(kind, rows, batch, done):
        if kind == "verify":
            runs.append(1)
        return inner(kind, rows, batch, done)

    sched._execute = counting
    try:
        params = _params(1.0, lengths=(60, 60, 60, 60, 60))
        base = await _run(plain, params, "p")
        if stop:
            text = plain.tokenizer.decode([t for o in base for t in o.output_ids])
            common, count = Counter(ch for ch in text if not ch.isspace()).most_common(1)[0]
            assert count >= 20, text  # many tokens may end the stop string
            params = [replace(p, stop=["\x00" + common]) for p in params]
            base = await _run(plain, params, "q")
            assert all(o.finish_reason["type"] == "length" for o in base)
        ours = await _run(spec, params, "v")
        _same(ours, base)
        steps = spec.stats["spec_verify_steps"]
        assert steps >= 2 * len(runs) > 0, (steps, len(runs))  # several verify steps a run, on average
        # every token taken once: a request's first from its prefill, the rest from decode or verify steps
        made = sum(len(o.output_ids) for o in ours)
        assert made == len(ours) + spec.stats.get("decode_rows", 0) + spec.stats["spec_emitted_tokens"]
        assert not sched.active and not sched.in_flight
    finally:
        plain.shutdown()
        spec.shutdown()


async def test_a_search_that_finds_no_draft_backs_off(peaked_model_dir: Path) -> None:
    """Where drafts never come, the adaptive engine stops paying for the search at every step: after
    proposals that gave no row a draft it skips the drafter 1, 3, 7, then 15 times; with ``adaptive:
    false`` it asks at every step. The tokens are the plain engine's either way."""
    found: dict[bool, tuple[int, int, list]] = {}
    for adaptive in (True, False):
        config = SpeculativeConfig(num_draft_tokens=4, max_ngram=3, min_ngram=2, adaptive=adaptive)
        engine = EmbeddedEngine(peaked_model_dir, max_batch_size=4, batch_invariant=True, speculative=config)
        calls: list[int] = []

        def nothing(
            contexts: list[list[int]], budgets: list[int], calls: list[int] = calls
        ) -> list[list[int]]:
            calls.append(len(contexts))
            return [[] for _ in contexts]

        engine.scheduler.drafter.propose = nothing
        try:
            out = await _run(engine, _params(1.0, lengths=(60, 60, 60, 60, 60)), "n")
            found[adaptive] = (len(calls), engine.stats["decode_steps"], out)
        finally:
            engine.shutdown()
    (asked, steps, out), (asked_always, steps_always, out_always) = found[True], found[False]
    assert steps >= 60 and steps_always >= 60
    assert asked <= steps / 4 and asked_always >= steps_always / 2, (asked, steps, asked_always, steps_always)
    _same(out, out_always)


async def test_a_request_alone_or_in_a_crowd_gets_the_same_bits_with_speculation(
    peaked_model_dir: Path,
) -> None:
    """Deterministic mode's premise holds with speculation on: a request's bits do not depend on which
    requests share its steps (their drafts differ from step to step), nor on whether drafts ran at all."""
    prompts = _prompts()
    sp = RequestSampling(temperature=1.0, max_new_tokens=30, sampling_seed=3, ignore_eos=True)
    alone = EmbeddedEngine(peaked_model_dir, max_batch_size=8, batch_invariant=True)
    mine = await alone.generate(prompts[0], sp, "alone")
    alone.shutdown()
    crowd = EmbeddedEngine(peaked_model_dir, max_batch_size=8, batch_invariant=True, speculative=SPEC)
    others = [
        RequestSampling(temperature=1.0, max_new_tokens=10 + 7 * i, sampling_seed=50 + i, ignore_eos=True)
        for i in range(6)
    ]
    recs = await asyncio.gather(
        *(
            crowd.generate([9, *p], s, f"c{i}")
            for i, (p, s) in enumerate(zip(prompts[1:] * 2, others, strict=False))
        ),
        crowd.generate(prompts[0], sp, "mine"),
    )
    crowd.shutdown()
    _same([recs[-1]], [mine])


async def test_default_mode_speculation_keeps_the_tokens_and_logprobs_to_rounding(
    tiny_model_dir: Path,
) -> None:
    """Outside batch-invariant mode the verify forward (prefill kernels over several tokens) rounds
    differently from a decode step, as a prefill in chunks does: greedy tokens are the same and logprobs
    agree to float rounding."""
    plain = EmbeddedEngine(tiny_model_dir, max_batch_size=4)
    spec = EmbeddedEngine(tiny_model_dir, max_batch_size=4, speculative=SPEC)
    try:
        a = await _run(plain, _params(0.0), "a")
        b = await _run(spec, _params(0.0), "b")
        for x, y in zip(a, b, strict=True):
            assert x.output_ids == y.output_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4
        assert spec.stats["spec_accepted_tokens"] > 0
    finally:
        plain.shutdown()
        spec.shutdown()


async def test_rejection_acceptance_in_the_engine_emits_target_logprobs(peaked_model_dir: Path) -> None:
    """Rejection acceptance runs in the batch: every emitted token carries the raw-logit logprob of the
    model (HF's forward over the same tokens, to float rounding)."""
    from transformers import AutoModelForCausalLM

    spec = EmbeddedEngine(
        peaked_model_dir,
        max_batch_size=4,
        speculative=SpeculativeConfig(num_draft_tokens=4, max_ngram=3, min_ngram=1, acceptance="rejection"),
    )
    try:
        recs = await _run(spec, _params(1.0), "r")
    finally:
        spec.shutdown()
    assert spec.stats["spec_accepted_tokens"] > 0
    hf = AutoModelForCausalLM.from_pretrained(peaked_model_dir).eval()
    for r in recs:
        ids = torch.tensor([[*r.prompt_ids, *r.output_ids]])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        n = len(r.prompt_ids)
        want = [float(logp[n - 1 + j, t]) for j, t in enumerate(r.output_ids)]
        assert max(abs(a - b) for a, b in zip(want, r.logprobs, strict=True)) < 1e-4


@pytest.mark.slow
@PLAIN_RUN_GROUP
def test_a_deterministic_run_with_speculation_is_the_run_without_it(
    tmp_path: Path, search_r1_cache: Path
) -> None:
    """Deterministic mode keeps its guarantee with speculation on: two short ``train_async.py`` runs of the
    deterministic config, without (the session's earlier plain run when there is one) and with
    ``engine.speculative``, end with the same weights, bit for bit, and log the same figures apart from
    timings, the engine's counters and the prefix cache's hits, while the second one's engine ran verify
    steps."""
    from test_deterministic import _against_the_plain_run, _same_bytes

    from agentrl.metrics import read_metrics

    spec = ("engine.speculative.num_draft_tokens=4", "engine.speculative.min_ngram=1")
    (wa, ma), (wb, mb) = _against_the_plain_run(tmp_path, search_r1_cache, "spec", spec)
    _same_bytes(wa, wb)
    # prefix-cache hits follow the schedule, which speculation changes: without_timings leaves them out
    keys = {k for r in ma + mb for k in r}
    differ = sorted(k for k in keys if [r.get(k) for r in ma] != [r.get(k) for r in mb])
    assert not differ, [(k, [r.get(k) for r in ma], [r.get(k) for r in mb]) for k in differ]
    counted = [
        r.get("engine/spec_verify_steps", 0.0) for r in read_metrics(tmp_path / "spec" / "metrics.jsonl")
    ]
    assert max(counted) > 0, "no verify step ran"


@pytest.mark.gpu
@pytest.mark.parametrize("batch_invariant", [True, False])
async def test_speculation_on_a_gpu(peaked_model_dir: Path, batch_invariant: bool) -> None:
    """On a GPU in bf16, with CUDA graphs for the decode steps: 32 requests at once, with and without
    speculation. Batch-invariant mode gives the same bits; the default mode the same greedy tokens and
    logprobs to bf16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    prompts = [[9 + i % 5, *p] for i, p in enumerate(_prompts() * 7)][:32]

    def params(t: float) -> list[RequestSampling]:
        return [
            RequestSampling(temperature=t, max_new_tokens=48, sampling_seed=100 + i, ignore_eos=True)
            for i in range(len(prompts))
        ]

    async def run(speculative, t: float) -> tuple[list, dict]:
        engine = EmbeddedEngine(
            peaked_model_dir,
            device="cuda",
            dtype="bfloat16",
            max_batch_size=32,
            batch_invariant=batch_invariant,
            context_len=1024,
            speculative=speculative,
        )
        try:
            recs = await asyncio.gather(
                *(
                    engine.generate(p, s, f"r{i}")
                    for i, (p, s) in enumerate(zip(prompts, params(t), strict=True))
                )
            )
            return recs, dict(engine.stats)
        finally:
            engine.shutdown()

    for t in (0.0, 1.0) if batch_invariant else (0.0,):
        base, _ = await run(None, t)
        ours, stats = await run(SPEC, t)
        assert stats["spec_accepted_tokens"] > 0
        if batch_invariant:
            _same(ours, base)
            continue
        same = sum(x.output_ids == y.output_ids for x, y in zip(ours, base, strict=True))
        assert same >= len(base) - 2, same  # bf16 rounding may flip a near-tie
        for x, y in zip(ours, base, strict=True):
            n = next(
                (i for i, (a, b) in enumerate(zip(x.output_ids, y.output_ids, strict=True)) if a != b),
                len(x.output_ids),
            )
            assert (
                max((abs(a - b) for a, b in zip(x.logprobs[:n], y.logprobs[:n], strict=True)), default=0.0)
                < 0.1
            )
