"""Per-turn advantages of tree rollouts (agentrl.trainer.losses.compute_tree_advantages): hand-computed
terms, and the reduction to flat GRPO bit for bit when nothing branches (advantages and one training
step's loss and weights)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _trainer_helpers import make_trajectories

from agentrl.trainer.batch import batch_advantages, response_mask
from agentrl.trainer.losses import LossConfig, compute_advantages, compute_tree_advantages
from agentrl.types import Trajectory, TreePosition

ESTIMATORS = [
    {"advantage_estimator": "grpo"},
    {"advantage_estimator": "grpo", "normalize_advantage_std": False},
    {"advantage_estimator": "dr_grpo"},
    {"advantage_estimator": "reinforce_pp_baseline"},
]


def as_unbranched_trees(trajs: list[Trajectory]) -> list[Trajectory]:
    """The same rows as leaves of trees with k = 1: each its own tree, branched once into one child."""
    out = []
    for t in trajs:
        u = copy.deepcopy(t)
        offset = u.turns[1].end  # after the first model turn and its observation
        u.tree = TreePosition(f"{u.group_id}/{u.sample_index}", [0], [1], [offset])
        out.append(u)
    return out


def bits(x: torch.Tensor) -> bytes:
    return x.contiguous().numpy().tobytes()


@pytest.mark.parametrize("est", ESTIMATORS, ids=lambda e: "-".join(map(str, e.values())))
def test_unbranched_trees_give_grpo_advantages_bit_for_bit(est: dict[str, Any]) -> None:
    cfg = LossConfig(**est)
    flat = make_trajectories(600, num_groups=4, group_size=3, seed=7)
    trees = as_unbranched_trees(flat)
    mask = response_mask(flat)
    a = batch_advantages(flat, mask, cfg)
    b = batch_advantages(trees, mask, cfg)
    assert [bits(x) for x in a] == [bits(x) for x in b]
    # no branch_at at all: trees of one leaf without a branch point
    for t in trees:
        t.tree = TreePosition(t.tree.tree_id)
    c = batch_advantages(trees, mask, cfg)
    assert [bits(x) for x in a] == [bits(x) for x in c]


def test_tree_and_turn_terms_hand_computed() -> None:
    """Two trees of one task, each branched once into two leaves. Response: 2 shared tokens, 1
    observation token, then 2 tokens of the leaf's own."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    trees = [
        TreePosition("g/0", [0], [1], [3]),
        TreePosition("g/0", [1], [1], [3]),
        TreePosition("g/1", [0], [1], [3]),
        TreePosition("g/1", [1], [1], [3]),
    ]
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0]] * 4)
    cfg = LossConfig(advantage_estimator="dr_grpo")
    adv = compute_tree_advantages(rewards, ["g"] * 4, mask, cfg, trees)
    # tree means 0.5 and 0.0 -> tree term +0.25 / -0.25; tree g/0's children 1.0 and 0.0 -> +0.5 / -0.5;
    # tree g/1's children are equal -> 0
    expected = torch.tensor(
        [
            [0.25, 0.25, 0.0, 0.75, 0.75],
            [0.25, 0.25, 0.0, -0.25, -0.25],
            [-0.25, -0.25, 0.0, -0.25, -0.25],
            [-0.25, -0.25, 0.0, -0.25, -0.25],
        ]
    )
    assert torch.equal(adv, expected)
    grpo = compute_tree_advantages(rewards, ["g"] * 4, mask, LossConfig(), trees)
    std_trees = torch.tensor([0.5, 0.0], dtype=torch.float64).std()
    std_kids = torch.tensor([1.0, 0.0], dtype=torch.float64).std()
    assert grpo[0, 0].item() == pytest.approx(0.25 / (std_trees.item() + 1e-6))
    assert grpo[0, 3].item() == pytest.approx(
        0.25 / (std_trees.item() + 1e-6) + 0.5 / (std_kids.item() + 1e-6)
    )


def test_flat_rows_keep_their_grpo_advantage_beside_trees() -> None:
    """compute_tree_advantages with no tree at all is compute_advantages."""
    rewards = torch.tensor([1.0, 0.0, 0.5])
    mask = torch.ones(3, 4)
    cfg = LossConfig()
    got = compute_tree_advantages(rewards, ["a", "a", "a"], mask, cfg, [None, None, None])
    assert bits(got) == bits(compute_advantages(rewards, ["a", "a", "a"], mask, cfg))


def _trainer(model_dir: Path) -> Any:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    return MegatronTrainer(TrainerConfig(model_path=str(model_dir), lr=1e-3, micro_batch_size=2))


def test_one_training_step_is_the_same_with_unbranched_trees(tiny_model_dir: Path) -> None:
    flat = make_trajectories(600, num_groups=3, group_size=2, seed=11)
    results = []
    for batch in (flat, as_unbranched_trees(flat)):
        tr = _trainer(tiny_model_dir)
        try:
            metrics = tr.train_step(batch)
            weights = {k: v.detach().clone() for k, v in tr.module.state_dict().items() if torch.is_tensor(v)}
        finally:
            tr.shutdown()
        results.append((metrics, weights))
    (m0, w0), (m1, w1) = results
    timing = ("time", "_s", "per_s", "mem")
    keys = [k for k in m0 if not any(t in k for t in timing)]
    assert "loss" in " ".join(keys)
    for k in keys:
        assert m0[k] == m1[k] or (m0[k] != m0[k] and m1[k] != m1[k]), k  # equal, or both NaN
    for k, v in w0.items():
        assert bits(v) == bits(w1[k]), k
