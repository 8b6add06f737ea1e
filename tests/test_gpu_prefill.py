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
