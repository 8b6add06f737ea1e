"""True on-policy on CPU (fp32): with ``trainer.true_on_policy`` the trainer's logprobs equal the
batch-invariant embedded engine's bit for bit, for multi-turn episodes generated concurrently with prefix
reuse and chunked prefill: mismatch KL exactly 0, max |Δ log p| 0, first-step PPO-KL 0, every TIS
weight 1; and again after the trainer's updated weights reach the engine."""

from __future__ import annotations

import asyncio
import os
import warnings
from pathlib import Path

import pytest
import torch

from agentrl.embedded.engine import EmbeddedEngine
from agentrl.embedded.sampling import RequestSampling
from agentrl.types import Trajectory


def _trainer(model_dir: Path, true_on_policy: bool, pack: bool = False):
    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.losses import LossConfig
    from agentrl.trainer.trainer import MegatronTrainer

    return MegatronTrainer(
        TrainerConfig(
            model_path=str(model_dir),
            lr=1e-2,
            micro_batch_size=3,
            pack_sequences=pack,
            max_tokens_per_micro_batch=160 if pack else None,
            true_on_policy=true_on_policy,
            old_logprobs="recompute",  # π_old from its own forward, compared with the rollout's μ
            loss=LossConfig(tis="token"),
        )
    )


async def _episodes(engine: EmbeddedEngine, n: int, version: int, seed: int) -> list[Trajectory]:
    """Two-turn episodes, all in flight at once (the second turn reuses the first's KV)."""
    g = torch.Generator().manual_seed(seed)

    async def one(i: int) -> Trajectory:
        prompt = torch.randint(3, 500, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g).tolist()
        t = Trajectory(task_id=f"t{i}", group_id=f"g{i // 3}", prompt_ids=prompt)
        sp = RequestSampling(temperature=1.0, max_new_tokens=10, sampling_seed=seed + i, ignore_eos=True)
        r = await engine.generate(prompt, sp, f"{seed}-{i}-a")
        t.append_model_tokens(r.output_ids, r.logprobs, version)
        t.append_observation_tokens([5, 6, 7, 8])
        sp2 = RequestSampling(
            temperature=1.0, max_new_tokens=6, sampling_seed=seed + 100 + i, ignore_eos=True
        )
        r2 = await engine.generate(t.input_ids, sp2, f"{seed}-{i}-b")
        t.append_model_tokens(r2.output_ids, r2.logprobs, version)
        t.reward = float(i % 3 == 0)
        return t

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def _max_gap(trainer, trajs: list[Trajectory]) -> float:
    """max |trainer - engine| logprob over the model's tokens (observation tokens have none)."""
    return max(
        abs(a - b)
        for t, lp in zip(trajs, trainer.compute_logprobs(trajs), strict=True)
        for a, b, m in zip(lp, t.rollout_logprobs, t.loss_mask, strict=True)
        if m
    )


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen2-packed"])
async def test_trainer_logprobs_equal_the_engines_bit_for_bit(
    tiny_model_factory, arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen2-packed: micro-batches of whole sequences end to end (a token budget of 160), run packed."""
    arch, pack = arch.removesuffix("-packed"), arch.endswith("-packed")
    if arch == "qwen3":  # the LM head in chunks of 37 token rows (recomputed in backward): the same bits
        from agentrl.trainer.true_on_policy import TrueOnPolicyLogprobs

        monkeypatch.setattr(TrueOnPolicyLogprobs, "HEAD_CHUNK", 37)
    model = tiny_model_factory(arch)
    engine = EmbeddedEngine(
        model, max_batch_size=8, batch_invariant=True, prefix_cache_slots=8, max_prefill_tokens=32
    )
    tr = _trainer(model, true_on_policy=True, pack=pack)
    try:
        for step in range(2):
            trajs = await _episodes(engine, 9, tr.policy_version, seed=10 * step)
            assert any(t.num_turns == 2 for t in trajs)
            assert _max_gap(tr, trajs) == 0.0
            m = tr.train_step(trajs)
            assert m["mismatch_kl"] == 0.0 and m["mismatch_k1"] == 0.0
            assert m["mismatch_logprob_abs_diff_max"] == 0.0
            assert m["same_version_token_frac"] == 1.0  # every token sampled with the trainer's weights
            assert (
                m["mismatch_kl_same_version"] == 0.0
                and m["mismatch_logprob_abs_diff_max_same_version"] == 0.0
            )
            assert m["ppo_kl"] == 0.0  # π_old recomputed: equal to the update's first forward
            assert m["tis_weight_mean"] == 1.0 and m["tis_clip_frac"] == 0.0
            # the updated weights go to the engine (fp32 on disk: the same bits)
            out = tmp_path / f"w{step}"
            tr.save_hf(out)
            await engine.update_weights_from_disk(str(out), str(step + 1), abort_all=False)
            tr.policy_version += 1
    finally:
        engine.shutdown()
        tr.shutdown()


async def test_default_trainer_is_not_bitwise(tiny_model_dir: Path) -> None:
    """The contrast: the default forward (megatron layers, SDPA, fused log-softmax) is close, not equal."""
    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=8, batch_invariant=True)
    tr = _trainer(tiny_model_dir, true_on_policy=False)
    try:
        gap = _max_gap(tr, await _episodes(engine, 6, 0, seed=3))
        assert 0.0 < gap < 1e-4
    finally:
        engine.shutdown()
        tr.shutdown()


def test_gradient_through_the_exact_forward_is_the_defaults_up_to_rounding(tiny_model_dir: Path) -> None:
    """Autograd runs through the batch-invariant forward (megatron's fused projections read in place):
    d Σ logprob / dθ equals the default forward's up to rounding, on every parameter; without autograd the
    forward gives the same logprobs and no entropy."""
    from types import SimpleNamespace

    from agentrl.trainer.logprobs import ModelLogprobs
    from agentrl.trainer.true_on_policy import TrueOnPolicyLogprobs

    tr = _trainer(tiny_model_dir, true_on_policy=True)
    try:
        exact = tr.logprobs
        assert isinstance(exact, TrueOnPolicyLogprobs)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(3, 500, (3, 45), generator=g)
        mb = SimpleNamespace(tokens=tokens, targets=tokens.roll(-1, 1), packed=None)
        params = [p for p in tr.model.parameters() if p.requires_grad]
        lp, ent = exact.of(tr.model, mb)
        with torch.no_grad():
            values, none = exact.of(tr.model, mb)
        assert none is None and ent is not None and ent.shape == lp.shape
        assert torch.equal(lp, values)
        default_lp, _ = ModelLogprobs(tr.arch.vocab_size).of(tr.model, mb)
        assert not torch.equal(default_lp, lp) and torch.allclose(default_lp, lp, atol=1e-4)
        through = torch.autograd.grad(lp.sum(), params)
        default = torch.autograd.grad(default_lp.sum(), params)
        for a, b in zip(through, default, strict=True):
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-5 * b.abs().max().item())
    finally:
        tr.shutdown()


def test_a_packed_micro_batch_gives_the_padded_bits(tiny_model_dir: Path) -> None:
    """A packed micro-batch (sequences of unequal length end to end) runs packed: the logprobs at every
    real token are the padded run's bits, zeros at padding, and the gradient matches up to rounding."""
    from agentrl.trainer.batch import make_micro_batch

    tr = _trainer(tiny_model_dir, true_on_policy=True)
    try:
        g = torch.Generator().manual_seed(1)
        trajs = []
        for i, n in enumerate((7, 30, 18, 52)):
            t = Trajectory(
                task_id=str(i), group_id="g", prompt_ids=torch.randint(3, 500, (5,), generator=g).tolist()
            )
            t.append_model_tokens(torch.randint(3, 500, (n,), generator=g).tolist(), [0.0] * n, 0)
            trajs.append(t)
        adv = [torch.zeros(len(t.response_ids)) for t in trajs]
        padded = make_micro_batch(trajs, [0, 1, 2, 3], adv)
        packed = make_micro_batch(trajs, [0, 1, 2, 3], adv, pack=True)
        assert packed.packed is not None and packed.packed.tokens.shape[1] < padded.tokens.numel()
        real = torch.zeros(padded.tokens.shape, dtype=torch.bool)
        for row, t in enumerate(trajs):
            real[row, : len(t.prompt_ids) + len(t.response_ids) - 1] = True
        with torch.no_grad():
            a, _ = tr.logprobs.of(tr.model, padded)
            b, none = tr.logprobs.of(tr.model, packed)
        assert none is None
        assert torch.equal(a[real], b[real]) and not b[~real].any()
        params = [p for p in tr.model.parameters() if p.requires_grad]
        lp_a, ent_a = tr.logprobs.of(tr.model, padded)
        lp_b, ent_b = tr.logprobs.of(tr.model, packed)
        assert torch.equal(lp_a[real], lp_b[real]) and torch.allclose(ent_a[real], ent_b[real], atol=1e-5)
        ga = torch.autograd.grad(lp_a[real].sum(), params)
        gb = torch.autograd.grad(lp_b[real].sum(), params)
        for x, y in zip(ga, gb, strict=True):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-6 * y.abs().max().item())
    finally:
        tr.shutdown()
