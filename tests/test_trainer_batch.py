"""Batch preparation of the train step, pure CPU (no torch.distributed): dropped trajectories are
counted, advantages are per response token, micro-batches respect their token budget, and the
mini-batch plan splits the batch in order, per data-parallel rank, with whole-mini-batch denominators."""

from __future__ import annotations

import pytest
import torch
from _trainer_helpers import make_trajectories

from agentrl.trainer.batch import (
    batch_advantages,
    input_length,
    make_micro_batch,
    plan_mini_batches,
    response_mask,
    select_usable,
    split_micro_batches,
)
from agentrl.trainer.losses import LossConfig
from agentrl.types import Status


def test_select_usable_drops_and_counts_failed_and_unrewarded() -> None:
    trajs = make_trajectories(600, num_groups=3, group_size=2, seed=1)
    trajs[0].status, trajs[0].error = Status.FAILED, "tool crashed"
    trajs[1].reward = None
    trajs[2].prompt_ids = []
    usable, dropped = select_usable(trajs)
    assert dropped == 3
    assert usable == trajs[3:]

    usable, dropped = select_usable(trajs, sft=True)  # SFT needs no reward
    assert dropped == 2 and trajs[1] in usable


def test_select_usable_raises_when_nothing_is_left_and_validates() -> None:
    trajs = make_trajectories(600, num_groups=1, group_size=2)
    for t in trajs:
        t.reward = None
    with pytest.raises(ValueError, match="no usable trajectory \\(2 failed or unrewarded\\)"):
        select_usable(trajs)
    broken = make_trajectories(600, num_groups=1, group_size=1)
    broken[0].loss_mask.pop()
    with pytest.raises(ValueError, match="loss_mask"):
        select_usable(broken)


def test_advantages_are_per_response_token_and_zero_in_sft() -> None:
    trajs = make_trajectories(600, num_groups=2, group_size=2, seed=3)
    mask = response_mask(trajs)
    assert mask.shape == (4, max(len(t.response_ids) for t in trajs))
    adv = batch_advantages(trajs, mask, LossConfig())
    assert [len(a) for a in adv] == [len(t.response_ids) for t in trajs]
    for a, t in zip(adv, trajs, strict=True):
        assert torch.all(a[torch.tensor(t.loss_mask) == 0] == 0)  # observation tokens get none
    assert any(a.abs().sum() > 0 for a in adv)
    sft = batch_advantages(trajs, mask, LossConfig(mode="sft"))
    assert all(torch.all(a == 0) for a in sft)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_an_episode_of_two_rows_counts_once_in_its_group(estimator: str) -> None:
    """An agent episode that split into two rows (drift, a new conversation) shares one reward; the
    group's baseline counts it once, so the advantages equal those of the same episodes as one row each."""
    one_row = make_trajectories(600, num_groups=1, group_size=3, seed=5)
    for t, r in zip(one_row, [1.0, 0.0, 0.0], strict=True):
        t.reward = r
        t.episode_id = f"{t.group_id}/{t.sample_index}"
    cfg = LossConfig(advantage_estimator=estimator)
    base = batch_advantages(one_row, response_mask(one_row), cfg)

    extra = make_trajectories(600, num_groups=1, group_size=1, seed=6)[0]  # episode 0's second row
    extra.reward, extra.episode_id = 1.0, one_row[0].episode_id
    two_rows = [one_row[0], extra, one_row[1], one_row[2]]
    adv = batch_advantages(two_rows, response_mask(two_rows), cfg)
    for a, b in zip([adv[0], adv[2], adv[3]], base, strict=True):
        assert torch.equal(a, b)
    ep_adv = base[0][torch.tensor(one_row[0].loss_mask) == 1][0]
    assert ep_adv > 0 and torch.all(adv[1][torch.tensor(extra.loss_mask) == 1] == ep_adv)

    for t in two_rows:  # without episode ids each row is an episode of its own: episode 0 counts twice
        t.episode_id = None
    assert not torch.equal(batch_advantages(two_rows, response_mask(two_rows), cfg)[2], base[1])

    one_row[0].episode_id = extra.episode_id = "g0/0"
    extra.reward = 0.5  # one episode, two rewards: a bug upstream, not averaged away
    with pytest.raises(ValueError, match=r"its rows have rewards 1\.0 and 0\.5"):
        batch_advantages(two_rows, response_mask(two_rows), cfg)


def test_split_micro_batches_by_count_and_by_token_budget() -> None:
    assert split_micro_batches([5, 5, 5, 5, 5], 2, None) == [[0, 1], [2, 3], [4]]
    lengths = [5, 5, 5, 20, 3, 3]
    groups = split_micro_batches(lengths, 99, 12)
    assert groups == [[0, 1], [2], [3], [4, 5]]  # 20 > 12 goes alone
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 12


def test_micro_batch_aligns_targets_with_the_response() -> None:
    trajs = make_trajectories(600, num_groups=1, group_size=2, seed=5)
    adv = [torch.full((len(t.response_ids),), 2.0) for t in trajs]
    mb = make_micro_batch(trajs, [0, 1], adv, pad_id=0)
    assert mb.tokens.shape == (2, max(input_length(t) for t in trajs))
    for row, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        assert mb.targets[row, p - 1 : p - 1 + r].tolist() == t.response_ids
        assert mb.loss_mask[row].sum() == sum(t.loss_mask)
        assert torch.equal(mb.advantages[row], 2.0 * mb.loss_mask[row])


def test_plan_splits_mini_batches_per_rank_with_global_denominators() -> None:
    trajs = make_trajectories(600, num_groups=3, group_size=2, seed=7)
    mask = response_mask(trajs)
    adv = batch_advantages(trajs, mask, LossConfig())
    kw = dict(num_mini_batches=2, micro_batch_size=1, max_tokens_per_micro_batch=None, dp_size=2)
    plans = [plan_mini_batches(trajs, adv, mask, dp_rank=r, **kw) for r in range(2)]
    assert [len(p) for p in plans] == [2, 2]
    # mini-batch j covers trajectories [3j, 3j+3); rank r takes every other one of them
    seen = [[i for mb in p[j].micro_batches for i in mb.traj_index] for p in plans for j in range(2)]
    assert seen == [[0, 2], [3, 5], [1], [4]]
    for j in range(2):
        want = mask[3 * j : 3 * j + 3].sum()
        assert plans[0][j].denom == plans[1][j].denom
        assert plans[0][j].denom.num_tokens == float(want)
        assert plans[0][j].denom.num_seqs == 3.0

    assert len(plan_mini_batches(trajs, adv, mask, 10, 4)) == len(trajs)  # at most one per trajectory
    fixed = plan_mini_batches(trajs, adv, mask, 1, 4, fixed_shape=True)[0].micro_batches
    assert [mb.tokens.shape for mb in fixed] == [fixed[0].tokens.shape] * 2
    assert fixed[0].tokens.shape == (4, max(input_length(t) for t in trajs))
