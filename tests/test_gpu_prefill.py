"""The packed prefill on a GPU (``agentrl.embedded.attention``), eager and graph-captured, against the
padded SDPA prefill: the same logits and KV cache for fresh prompts, prompts after a prefix, chunked
prompts and rows longer than one kernel block; decoding after either reads the same cache
(``python -m pytest -m gpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from agentrl.embedded.runner import ExtendBatch, ModelRunner

pytestmark = pytest.mark.gpu


def _runners(model_dir: Path, dtype: torch.dtype, graphs: bool = False) -> tuple[ModelRunner, ModelRunner]:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    packed = ModelRunner(model, num_slots=8, context_len=512, max_batch=4, cuda_graphs=graphs)
    padded = ModelRunner(model, num_slots=8, context_len=512, max_batch=4, cuda_graphs=False)
    assert packed.packed_prefill, "the packed prefill serves this model on a GPU"
    padded.packed_prefill = False
    return packed, padded


def _steps(vocab: int) -> list[ExtendBatch]:
    g = torch.Generator().manual_seed(0)

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    first = ExtendBatch([0, 1, 2, 5], [toks(150), toks(7), toks(64), toks(65)], [0, 0, 0, 0])
    # every row continues after its cache: a turn's observation, one token, a chunk of a long prompt
    second = ExtendBatch([0, 1, 2, 5], [toks(40), toks(1), toks(200), toks(3)], [150, 7, 64, 65])
    # and a fresh row beside cached ones
    third = ExtendBatch([3, 1], [toks(90), toks(130)], [0, 8])
    return [first, second, third]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_prefill_equals_padded_prefill(tiny_model_dir: Path, dtype: torch.dtype, graphs: bool) -> None:
    """Eager, and replaying the captured graph of each step's token bucket (padded with tokens that
    write only the scratch column and empty kernel blocks)."""
    packed, padded = _runners(tiny_model_dir, dtype, graphs)
    assert bool(packed.prefill_buckets) == graphs
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    for batch in _steps(packed.vocab_size):
        a, b = packed.extend(batch), padded.extend(batch)
        torch.testing.assert_close(a, b, **tol)
        if dtype == torch.float32:
            assert torch.equal(a.argmax(-1), b.argmax(-1))
    for slot, n in ((0, 190), (1, 138), (2, 264), (3, 90), (5, 68)):
        torch.testing.assert_close(packed.k[:, slot, :, :n], padded.k[:, slot, :, :n], **tol)
        torch.testing.assert_close(packed.v[:, slot, :, :n], padded.v[:, slot, :, :n], **tol)
    # decoding reads what either prefill wrote: slots 0..3 hold sequences of 190, 138, 264 and 90 tokens
    positions = [190, 138, 264, 90]
    ids = [5, 6, 7, 8]
    for _ in range(4):
        a, b = packed.decode(ids, positions), padded.decode(ids, positions)
        torch.testing.assert_close(a, b, **tol)
        ids = a.argmax(-1).tolist()
        positions = [p + 1 for p in positions]


def test_packed_prefill_serves_a_qwen3_moe_model(tiny_model_factory) -> None:
    """Qwen3 (q/k norms) and mixture-of-experts layers through the packed path: the experts each token
    was routed to are written where its keys go."""
    model_dir = tiny_model_factory("qwen3_moe", num_experts=8, num_experts_per_tok=2)
    packed, padded = _runners(model_dir, torch.float32, graphs=True)
    assert not packed.prefill_buckets  # eager: the experts' grouped GEMMs are not captured
    for batch in _steps(packed.vocab_size)[:2]:
        torch.testing.assert_close(packed.extend(batch), padded.extend(batch), atol=1e-4, rtol=1e-4)
    assert torch.equal(packed.routed[:, :3, :190], padded.routed[:, :3, :190])
    assert (packed.routed[:, 0, :190] >= 0).all()


def test_slot_copies_in_one_launch_per_wave_equal_copies_one_by_one() -> None:
    """The Triton slot copies (agentrl.embedded.slot_copy), a wave per launch, against torch's copies one
    by one, on random copies and on the scheduler's insert-then-compact pattern."""
    import random

    from agentrl.embedded.slot_copy import copy_slots, copy_waves

    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    rng = random.Random(0)
    for trial in range(20):
        k = torch.randn(3, 10, 2, 301, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        copies = []
        for _ in range(rng.randrange(1, 16)):
            start = rng.randrange(300)
            copies.append((rng.randrange(10), rng.randrange(10), rng.randrange(start, 301), start))
        if trial % 2:
            copies = [c for i in range(4) for c in ((i, 5 + i, 300, 0), (9 - i, i, 200 + i, 0))]
        want_k, want_v = k.clone(), v.clone()
        for src, dst, n, start in copies:
            want_k[:, dst, :, start:n] = want_k[:, src, :, start:n].clone()
            want_v[:, dst, :, start:n] = want_v[:, src, :, start:n].clone()
        assert copy_slots(k, v, copies) == len(
            copy_waves(copies)
        )  # one launch per wave (none: nothing to do)
        assert torch.equal(k, want_k) and torch.equal(v, want_v), (trial, copies)
