"""The RL losses against hand-computed values: advantages, PPO clipping (asymmetric, dual), GSPO,
aggregations, KL estimators, entropy, TIS / MIS / geometric rejection, bypass mode, loss masks, SFT."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.config import ConfigError, build_config
from agentrl.trainer.losses import (
    Denominators,
    LossConfig,
    MetricSums,
    compute_advantages,
    kl_penalty,
    off_policy_weights,
    policy_loss,
    sequence_denominators,
)

T = torch.tensor


def cfg(**kw) -> LossConfig:
    return LossConfig(**kw)


# ---- advantages ----------------------------------------------------------------------------------
def test_grpo_advantages_hand_computed() -> None:
    rewards = T([1.0, 0.0, 0.5, 0.5, 2.0])
    groups = ["a", "a", "b", "b", "c"]
    mask = T([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    adv = compute_advantages(rewards, groups, mask, cfg(advantage_estimator="grpo"))
    s = math.sqrt(0.5)  # unbiased std of {1, 0}
    assert torch.allclose(adv[0], T([0.5 / s, 0.5 / s, 0.0]), atol=1e-5)
    assert torch.allclose(adv[1], T([-0.5 / s, 0.0, 0.0]), atol=1e-5)
    assert torch.equal(adv[2], torch.zeros(3))  # equal rewards: no signal, no NaN
    assert torch.equal(adv[4], torch.zeros(3))  # group of one: no baseline
    dr = compute_advantages(rewards, groups, mask, cfg(advantage_estimator="dr_grpo"))
    assert torch.allclose(dr[0], T([0.5, 0.5, 0.0])) and torch.allclose(dr[1], T([-0.5, 0.0, 0.0]))
    nostd = compute_advantages(rewards, groups, mask, cfg(normalize_advantage_std=False))
    assert torch.allclose(nostd, dr)


def test_reinforce_pp_baseline_whitens_over_tokens() -> None:
    rewards = T([1.0, 0.0, 3.0, 1.0])
    mask = T([[1, 1], [1, 0], [1, 1], [0, 1]], dtype=torch.float32)
    adv = compute_advantages(
        rewards, ["a", "a", "b", "b"], mask, cfg(advantage_estimator="reinforce_pp_baseline")
    )
    # centred per group: +0.5, -0.5, +1, -1, broadcast over the 6 masked tokens, then whitened
    vals = torch.tensor([0.5, 0.5, -0.5, 1.0, 1.0, -1.0], dtype=torch.float64)
    expect = (vals - vals.mean()) / vals.std(unbiased=True)
    got = adv[mask.bool()]
    assert torch.allclose(got, expect.float(), atol=1e-5)
    assert adv[1, 1] == 0 and adv[3, 0] == 0


# ---- PPO surrogate -------------------------------------------------------------------------------
def _ppo(lp, old, adv, mask, **kw):
    c = cfg(tis="none", **kw)
    m = MetricSums()
    mask = T(mask, dtype=torch.float32)
    loss = policy_loss(T(lp), T(old), T(adv), mask, c, sequence_denominators(mask), metrics=m)
    return loss, m.means()


def test_ppo_asymmetric_clip_hand_computed() -> None:
    # ratios e^0.5=1.6487 (A>0: clipped at 1.28), e^-0.5=0.6065 (A<0: clipped at 0.8), 1 (A>0)
    lp = [[0.5, -0.5, 0.0]]
    loss, m = _ppo(
        lp, [[0.0, 0.0, 0.0]], [[1.0, -2.0, 3.0]], [[1, 1, 1]], eps_clip_low=0.2, eps_clip_high=0.28
    )
    expect = (-1.0 * 1.28 + 2.0 * 0.8 - 3.0 * 1.0) / 3
    assert loss.item() == pytest.approx(expect, abs=1e-6)
    assert m["ppo_clip_frac"] == pytest.approx(2 / 3)
    assert m["ppo_clip_frac_high"] == pytest.approx(1 / 3) and m["ppo_clip_frac_low"] == pytest.approx(1 / 3)
    assert m["ppo_kl"] == pytest.approx(0.0, abs=1e-7)  # mean(old - new) = 0 here


def test_ppo_gradient_zero_when_clipped() -> None:
    lp = T([[0.5, 0.1]], requires_grad=True)
    mask = T([[1.0, 1.0]])
    c = cfg(tis="none")
    loss = policy_loss(lp, T([[0.0, 0.0]]), T([[1.0, 1.0]]), mask, c, sequence_denominators(mask))
    loss.backward()
    assert lp.grad[0, 0] == 0  # ratio 1.65 > 1.28 with A > 0: clipped, no gradient
    assert lp.grad[0, 1].item() == pytest.approx(-math.exp(0.1) / 2, rel=1e-5)


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    # ratio e^2 = 7.39 with A = -1: the standard clip gives 7.39, dual clip c=3 caps it at 3
    loss, m = _ppo([[2.0]], [[0.0]], [[-1.0]], [[1]], dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert m["dual_clip_frac"] == 1.0
    loss_nodual, _ = _ppo([[2.0]], [[0.0]], [[-1.0]], [[1]])
    assert loss_nodual.item() == pytest.approx(math.exp(2.0), rel=1e-6)


def test_gspo_uses_sequence_ratio() -> None:
    lp = T([[0.2, -0.1, 0.5]], requires_grad=True)
    mask = T([[1.0, 1.0, 0.0]])
    c = cfg(mode="gspo", tis="none", aggregation="seq_mean_token_mean", eps_clip_low=0.5, eps_clip_high=0.5)
    loss = policy_loss(lp, torch.zeros(1, 3), T([[1.0, 1.0, 1.0]]), mask, c, sequence_denominators(mask))
    s = math.exp((0.2 - 0.1) / 2)  # exp(mean log ratio over the 2 masked tokens)
    assert loss.item() == pytest.approx(-s, rel=1e-6)
    loss.backward()
    # d(-s)/d lp_t = -s / |y| for masked tokens, 0 for the masked-out one
    assert torch.allclose(lp.grad, T([[-s / 2, -s / 2, 0.0]]), atol=1e-6)


def test_aggregations_and_loss_mask() -> None:
    lp = torch.zeros(2, 3)
    adv = T([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # the 100s are prompt / observation positions
    d = sequence_denominators(mask)
    assert d == Denominators(num_tokens=4.0, num_seqs=2.0)
    get = lambda agg, **kw: policy_loss(lp, lp, adv, mask, cfg(tis="none", aggregation=agg, **kw), d).item()  # noqa: E731
    assert get("token_mean") == pytest.approx(-(1 + 2 + 3 + 4) / 4)
    assert get("seq_mean_token_mean") == pytest.approx(-((1 + 2 + 3) / 3 + 4) / 2)
    assert get("token_sum", token_sum_norm=5.0) == pytest.approx(-(1 + 2 + 3 + 4) / (2 * 5.0))
    # global denominators: two halves of a batch add up to the whole
    whole = get("token_mean")
    h1 = policy_loss(lp[:1], lp[:1], adv[:1], mask[:1], cfg(tis="none"), d).item()
    h2 = policy_loss(lp[1:], lp[1:], adv[1:], mask[1:], cfg(tis="none"), d).item()
    assert h1 + h2 == pytest.approx(whole)


def test_masked_tokens_get_no_gradient_even_with_extreme_values() -> None:
    lp = T([[0.0, 50.0]], requires_grad=True)
    mask = T([[1.0, 0.0]])
    loss = policy_loss(
        lp,
        T([[0.0, -50.0]]),
        T([[1.0, 1e6]]),
        mask,
        cfg(tis="token"),
        sequence_denominators(mask),
        rollout_logprobs=T([[0.0, 80.0]]),
        entropy=T([[1.0, 1e9]]),
        ref_logprobs=T([[0.0, -1e3]]),
    )
    loss.backward()
    assert torch.isfinite(loss) and lp.grad[0, 1] == 0


# ---- KL / entropy -------------------------------------------------------------------------------
def test_kl_estimators_hand_computed() -> None:
    lp, ref = T([0.0, -1.0]), T([-0.5, -0.5])
    d = lp - ref  # [0.5, -0.5]
    assert torch.allclose(kl_penalty(lp, ref, "k1"), d)
    assert torch.allclose(kl_penalty(lp, ref, "k2"), 0.5 * d**2)
    k3 = torch.exp(-d) - 1 + d
    assert torch.allclose(kl_penalty(lp, ref, "k3"), k3)
    assert torch.allclose(kl_penalty(lp, ref, "low_var_kl"), k3)
    assert kl_penalty(T([0.0]), T([-100.0]), "low_var_kl").item() == 10.0  # clamped


def test_kl_and_entropy_terms_in_loss() -> None:
    lp, mask = T([[-1.0, -2.0]]), T([[1.0, 1.0]])
    ref, ent = T([[-1.5, -1.5]]), T([[2.0, 4.0]])
    c = cfg(tis="none", kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    m = MetricSums()
    loss = policy_loss(
        lp,
        lp,
        torch.zeros(1, 2),
        mask,
        c,
        sequence_denominators(mask),
        entropy=ent,
        ref_logprobs=ref,
        metrics=m,
    )
    assert loss.item() == pytest.approx(0.1 * ((0.5 - 0.5) / 2) - 0.01 * 3.0)
    assert m.means()["entropy"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, lp, mask, c, sequence_denominators(mask))


# ---- off-policy correction -----------------------------------------------------------------------
def test_same_version_mismatch_leaves_out_the_policys_lag() -> None:
    """Over the tokens sampled with π_old's own weights the mismatch is numerics alone; the tokens of an
    older version add the policy's lag to the overall figures only."""
    old = T([[0.0, 0.0, 0.0, 0.0, 0.0]])
    mu = T([[0.0, 0.05, math.log(0.5), math.log(4.0), 0.0]])  # tokens 2, 3: sampled a version earlier
    mask = T([[1.0, 1.0, 1.0, 1.0, 0.0]])
    same = torch.tensor([[True, True, False, False, True]])
    m = MetricSums()
    off_policy_weights(old, mu, mask, cfg(tis="token"), m, same_version=same)
    means, maxes = m.means(), m.maxes
    assert means["same_version_token_frac"] == pytest.approx(0.5)  # 2 of the 4 scored tokens
    assert means["mismatch_kl_same_version"] == pytest.approx((math.exp(-0.05) - 1 + 0.05) / 2, rel=1e-3)
    assert float(maxes["mismatch_logprob_abs_diff_max_same_version"]) == pytest.approx(0.05, rel=1e-5)
    assert float(maxes["mismatch_logprob_abs_diff_max"]) == pytest.approx(math.log(4.0), rel=1e-6)
    assert means["mismatch_kl"] > 100 * means["mismatch_kl_same_version"]
    m2 = MetricSums()
    off_policy_weights(old, mu, mask, cfg(tis="token"), m2)
    assert not any("same_version" in k for k in (*m2.sums, *m2.maxes))


def test_token_tis_hand_computed() -> None:
    old = T([[0.0, 0.0, 0.0, 0.0]])
    mu = T([[math.log(0.5), math.log(2.0), 0.0, math.log(0.1)]])  # ρ = π_old/μ = 2, 0.5, 1, 10
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    m = MetricSums()
    w = off_policy_weights(old, mu, mask, cfg(tis="token", tis_cap=1.5), m)
    assert torch.allclose(w.weights[0, :3], T([1.5, 0.5, 1.0]))
    means = m.means()
    assert means["tis_clip_frac"] == pytest.approx(1 / 3)  # only the masked-in ρ=2 counts; ρ=10 is masked
    expect_k3 = sum(math.exp(-x) - 1 + x for x in (math.log(0.5), math.log(2.0), 0.0)) / 3
    assert means["mismatch_kl"] == pytest.approx(expect_k3, rel=1e-5)
    assert means["mismatch_logprob_abs_diff_max"] == pytest.approx(math.log(2.0), rel=1e-6)
    # in the loss: per-token pg times w; lp = old so ratio = 1, pg = -A
    loss = policy_loss(
        old,
        old,
        T([[1.0, 1.0, 1.0, 1.0]]),
        mask,
        cfg(tis="token", tis_cap=1.5),
        sequence_denominators(mask),
        rollout_logprobs=mu,
    )
    assert loss.item() == pytest.approx(-(1.5 + 0.5 + 1.0) / 3, rel=1e-6)


def test_sequence_tis_and_mis_masks() -> None:
    old = torch.zeros(2, 2)
    mu = T([[math.log(0.5), math.log(0.5)], [0.0, math.log(4.0)]])  # seq ρ: 4 and 0.25; token ρ: 2,2 / 1,0.25
    mask = torch.ones(2, 2)
    w = off_policy_weights(old, mu, mask, cfg(tis="sequence", tis_cap=2.0))
    assert torch.allclose(w.weights, T([[2.0, 2.0], [0.25, 0.25]]))
    m = MetricSums()
    tok = off_policy_weights(old, mu, mask, cfg(tis="none", mis="token", mis_low=0.5, mis_high=1.5), m)
    assert torch.equal(tok.keep, T([[0.0, 0.0], [1.0, 0.0]]))
    assert m.means()["masked_frac"] == pytest.approx(3 / 4)
    seq = off_policy_weights(old, mu, mask, cfg(tis="none", mis="sequence", mis_low=0.5, mis_high=5.0))
    assert torch.equal(seq.keep, T([[1.0, 1.0], [0.0, 0.0]]))


def test_geometric_rejection() -> None:
    old = torch.zeros(2, 2)
    mu = T([[math.log(0.5), math.log(2.0)], [math.log(0.5), math.log(0.5)]])  # geo mean ρ: 1 and 2
    m = MetricSums()
    w = off_policy_weights(
        old, mu, torch.ones(2, 2), cfg(tis="none", geo_reject_low=0.8, geo_reject_high=1.25), m
    )
    assert torch.equal(w.keep, T([[1.0, 1.0], [0.0, 0.0]]))
    assert m.means()["rejected_seq_frac"] == 0.5
    # rejected sequences contribute nothing to the loss
    loss = policy_loss(
        old,
        old,
        torch.ones(2, 2),
        torch.ones(2, 2),
        cfg(tis="none", geo_reject_low=0.8, geo_reject_high=1.25),
        sequence_denominators(torch.ones(2, 2)),
        rollout_logprobs=mu,
    )
    assert loss.item() == pytest.approx(-2 / 4)


def test_bypass_mode_uses_rollout_logprobs_as_old() -> None:
    lp = T([[0.3]])
    mu = T([[0.0]])
    stale_old = T([[5.0]])  # ignored in bypass mode
    c = cfg(off_policy="bypass", tis="token", eps_clip_high=1.0)
    m = MetricSums()
    loss = policy_loss(
        lp,
        stale_old,
        T([[1.0]]),
        T([[1.0]]),
        c,
        sequence_denominators(T([[1.0]])),
        rollout_logprobs=mu,
        metrics=m,
    )
    assert loss.item() == pytest.approx(-math.exp(0.3), rel=1e-6)  # ratio π_θ/μ, weight 1
    assert m.means()["mismatch_kl"] == 0.0 and m.means()["tis_weight_mean"] == 1.0


def test_sft_loss() -> None:
    lp = T([[-1.0, -2.0, -9.0]])
    mask = T([[1.0, 1.0, 0.0]])
    loss = policy_loss(lp, lp, torch.zeros(1, 3), mask, cfg(mode="sft"), sequence_denominators(mask))
    assert loss.item() == pytest.approx(1.5)


def test_config_validation_names_fields() -> None:
    with pytest.raises(ConfigError, match="tis_cap"):
        build_config(LossConfig, {"tis_cap": -1})
    with pytest.raises(ConfigError, match="mis_low"):
        build_config(LossConfig, {"mis_low": 3.0, "mis_high": 2.0})
    with pytest.raises(ConfigError, match="unknown field"):
        build_config(LossConfig, {"clip": 0.2})


def test_vocab_parallel_logprobs_single_rank_matches_log_softmax() -> None:
    from agentrl.trainer.logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 12, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 10, (2, 5), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, target, true_vocab_size=10)  # 2 padded vocab columns cut off
    ref = torch.log_softmax(logits[..., :10], -1)
    ref_lp = ref.gather(-1, target[..., None]).squeeze(-1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    w1, w2 = (
        torch.randn(2, 5, generator=g, dtype=torch.float64),
        torch.randn(2, 5, generator=g, dtype=torch.float64),
    )
    (grad,) = torch.autograd.grad((lp * w1 + ent * w2).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_lp * w1 + ref_ent * w2).sum(), logits)
    assert torch.allclose(grad, ref_grad, atol=1e-5)
    assert grad[..., 10:].abs().max() == 0


def test_metric_sums_read_once_and_equal_float_sums() -> None:
    # tensor metrics are summed (float64) where they live and read to the host once, at the end; the
    # means equal those of summing their Python floats, bit for bit; floats and tensors mix
    g = torch.Generator().manual_seed(0)
    vals = [torch.rand(7, generator=g) * 1e3 for _ in range(5)]
    m = MetricSums()
    m.add("x", 1.5, 1)
    m.max("top", 2.0)
    ref_sum, ref_cnt = 1.5, 1.0
    for v in vals:
        m.add("x", v.sum(), (v > 500).sum())
        m.max("top", v.amax())
        ref_sum += float(v.sum())
        ref_cnt += float((v > 500).sum())
    assert isinstance(m.sums["x"], torch.Tensor) and isinstance(m.maxes["top"], torch.Tensor)
    out = m.means()
    assert out["x"] == ref_sum / ref_cnt
    assert out["top"] == max(float(v.amax()) for v in vals)
    assert all(isinstance(d["x" if d is not m.maxes else "top"], float) for d in (m.sums, m.counts, m.maxes))
