"""Train-step behaviour on one CPU rank: the staleness assertion, failed trajectories dropped (never
fatal), a KL-to-reference term (reference = initial weights, so KL starts at 0), token-budget
micro-batching giving the same update as fixed-size micro-batches, and SFT mode reducing the loss."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from _trainer_helpers import make_trajectories

from agentrl.buffer import StalenessError
from agentrl.types import Status


def _trainer(model_dir: Path, **kw):
    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    return MegatronTrainer(TrainerConfig(model_path=str(model_dir), **kw))


def test_staleness_failures_kl_and_micro_batching(tiny_model_dir: Path) -> None:
    tr = _trainer(
        tiny_model_dir,
        lr=1e-3,
        micro_batch_size=2,
        loss={"kl_coef": 0.5, "kl_estimator": "k3", "entropy_coef": 0.01},
    )
    try:
        trajs = make_trajectories(600, seed=1, version=0)
        bad = make_trajectories(600, seed=2)[:2]
        bad[0].status, bad[0].error = Status.FAILED, "tool crashed"
        bad[1].reward = None
        m = tr.train_step(trajs + bad)
        assert m["dropped_trajectories"] == 2 and m["num_trajectories"] == 6
        assert m["ref_kl"] == 0.0  # the reference model starts equal to the policy
        m2 = tr.train_step(trajs)
        assert m2["ref_kl"] > 0.0  # ... and the policy has moved since

        tr.policy_version = 2  # tokens from version 0 are now 2 versions old > max_staleness 1
        with pytest.raises(StalenessError, match="staleness bound violated"):
            tr.train_step(trajs, max_staleness=1)
        tr.policy_version = 1
        tr.train_step(trajs, max_staleness=1)
    finally:
        tr.shutdown()


def test_token_budget_micro_batches_give_the_same_update(tiny_model_dir: Path) -> None:
    results = []
    for kw in ({"micro_batch_size": 6}, {"max_tokens_per_micro_batch": 40}):
        tr = _trainer(tiny_model_dir, lr=1e-3, grad_clip=0.0, **kw)
        try:
            m = tr.train_step(make_trajectories(600, seed=4))
            results.append((m["loss"], tr.hf_state_dict()))
        finally:
            tr.shutdown()
    (l1, w1), (l2, w2) = results
    assert l1 == pytest.approx(l2, abs=1e-6)
    for k in w1:
        assert (w1[k] - w2[k]).abs().max() <= 1e-4, k  # 0.1 x lr after one Adam step


def test_sft_mode_reduces_the_loss(tiny_model_dir: Path) -> None:
    tr = _trainer(tiny_model_dir, lr=1e-2, loss={"mode": "sft"})
    try:
        trajs = make_trajectories(600, seed=9)
        for t in trajs:
            t.reward = None  # SFT needs no reward
        losses = [tr.train_step(trajs)["loss"] for _ in range(5)]
        assert losses[-1] < losses[0] - 0.5
        assert torch.isfinite(torch.tensor(losses)).all()
    finally:
        tr.shutdown()


def test_trainer_loads_a_converted_megatron_dir(tiny_model_factory, tmp_path: Path) -> None:
    from agentrl.trainer.hf_checkpoint import hf_to_mcore
    from agentrl.trainer.model import load_hf_state_dict

    model_dir = tiny_model_factory("qwen3")
    hf_to_mcore(model_dir, tmp_path / "mc")
    tr = _trainer(model_dir, mcore_path=str(tmp_path / "mc"))
    try:
        got, want = tr.hf_state_dict(), load_hf_state_dict(model_dir)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        tr.shutdown()


def test_compile_warmup_leaves_the_training_state_alone(tiny_model_dir: Path) -> None:
    """The warm-up pass that compiles the layers before the first step (compiled layers on a GPU) runs
    forward and backward on made-up batches and drops the gradients: the next train step gives the same
    weights as without it. Here on CPU, uncompiled, the pass itself."""
    results = []
    for warm in (False, True):
        tr = _trainer(tiny_model_dir, lr=1e-3, pack_sequences=True, max_tokens_per_micro_batch=400)
        try:
            before = tr.hf_state_dict()
            if warm:
                from agentrl.trainer.build import compile_warmup

                assert compile_warmup(tr) > 0
                assert all(p.grad is None for p in tr.model.parameters())
                after = tr.hf_state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
            tr.train_step(make_trajectories(600, seed=4))
            results.append(tr.hf_state_dict())
        finally:
            tr.shutdown()
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
