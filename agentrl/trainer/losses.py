"""RL losses in pure torch, independent of the training backend: advantages, the clipped policy
objective with off-policy (rollout/trainer mismatch) correction, KL and entropy terms, SFT.

Notation (as in ``design.md``): ``μ`` is the rollout policy (the engine's logprobs), ``π_old`` the
trainer's recompute with the weights that sampled, ``π_θ`` the policy being updated. All per-token
tensors are ``[B, T]`` over *response* positions and multiplied by ``loss_mask`` (1 = model token), so
prompt and observation tokens never contribute to a loss or a metric.

Objective per token (decoupled PPO, AReaL; Yao et al. 2025 for TIS)::

    r   = π_θ / π_old                        (GSPO: the sequence ratio exp(mean_t log r), per token)
    ρ   = π_old / μ                           (1 in bypass mode, where π_old := μ)
    w   = min(ρ, C)  | min(Π_t ρ_t, C)        token / sequence TIS, detached
    m   = 1[α ≤ ρ ≤ β] | whole-sequence       MIS (IcePop) masks; geometric rejection of sequences
    pg  = -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A)   and, for A < 0 with dual clip c: min(pg, -c·A)
    loss_t = w·m·pg + kl_coef·KL(π_θ‖π_ref) - entropy_coef·H

Aggregation over tokens: ``token_mean`` (Σ loss / #tokens), ``seq_mean_token_mean`` (mean over
sequences of each sequence's token mean) or ``token_sum`` (Σ loss / (#sequences · token_sum_norm);
Dr.GRPO with ``token_sum_norm`` = max response length). Denominators are passed in so that gradient
accumulation over micro-batches and data-parallel ranks gives exactly the full-batch objective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agentrl.trainer.loss_config import LossConfig
from agentrl.types import TreePosition

Tensor = torch.Tensor


# ---- advantages -----------------------------------------------------------------------------------
def group_indices(group_ids: Sequence[str]) -> list[list[int]]:
    """Positions of each group, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return list(groups.values())


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(x - mean) / std over the masked entries (unbiased std, as verl); zeros where mask is 0."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def compute_advantages(
    rewards: Tensor,
    group_ids: Sequence[str],
    loss_mask: Tensor,
    cfg: LossConfig,
    episode_ids: Sequence[str | None] | None = None,
    turn_advantages: Tensor | None = None,
) -> Tensor:
    """Per-token advantages ``[B, T]`` from per-sequence ``rewards [B]`` (outcome reward).

    Groups (same ``group_id``) share the baseline. A group of one has advantage 0 under grpo/dr_grpo
    (no baseline to compare with); its std is taken as 1. Rows with the same ``episode_ids`` entry
    (not None) are one episode: its reward counts once in the group's mean and std, and every row of
    it gets the episode's advantage. A row whose entry is None (or no ``episode_ids``) is an episode.
    ``turn_advantages`` (``[B, T]``, tree rollouts) is added to the tokens before any whitening.
    """
    rewards = rewards.to(torch.float64)
    seq_adv = torch.zeros_like(rewards)
    for idx in group_indices(group_ids):
        first, of_row = _episodes(idx, episode_ids, rewards)
        r = rewards[first]
        centered = r - r.mean()
        if cfg.advantage_estimator == "grpo" and cfg.normalize_advantage_std:
            std = r.std(unbiased=True) if len(first) > 1 else torch.ones((), dtype=r.dtype)
            centered = centered / (std + cfg.advantage_eps)
        seq_adv[idx] = centered[of_row]
    mask = loss_mask.to(torch.float64)
    tok = seq_adv[:, None] * mask
    if turn_advantages is not None:
        tok = tok + turn_advantages.to(torch.float64) * mask
    if cfg.advantage_estimator == "reinforce_pp_baseline":
        tok = masked_whiten(tok, mask, cfg.advantage_eps)
    return tok.to(torch.float32)


def compute_tree_advantages(
    rewards: Tensor,
    group_ids: Sequence[str],
    loss_mask: Tensor,
    cfg: LossConfig,
    trees: Sequence[TreePosition | None],
) -> Tensor:
    """Per-token advantages ``[B, T]`` of tree-rollout leaves (:mod:`agentrl.rollout.tree`): the tree
    against the other trees of its task, plus each turn against its siblings.

    * Tree term: a tree is one episode of its group, with the mean reward of its leaves;
      :func:`compute_advantages` gives it to every token of every leaf.
    * Turn term: at a branch point, each child's subtree mean (the mean reward of the leaves below it)
      against the other children of that branch point, centred (and divided by their std + eps under
      grpo with ``normalize_advantage_std``), added to the tokens that child generated:
      ``response[branch_offsets[d] : branch_offsets[d + 1]]`` of each leaf below it (to the end at the
      last branch). Tokens before the first branch point carry the tree term alone.

    Rows without a tree (``None``) are flat episodes. With no branch point of two children or more (k = 1,
    or no ``branch_at``) this is :func:`compute_advantages` of the same rows, bit for bit.
    """
    r64 = rewards.to(torch.float64)
    by_tree: dict[str, list[int]] = {}
    for i, pos in enumerate(trees):
        if pos is not None:
            by_tree.setdefault(pos.tree_id, []).append(i)
    tree_rewards = rewards.clone()
    for rows in by_tree.values():
        tree_rewards[rows] = r64[rows].mean().to(rewards.dtype)
    episode_ids = [None if pos is None else pos.tree_id for pos in trees]
    turn = _turn_advantages(r64, trees, loss_mask.shape, cfg)
    return compute_advantages(tree_rewards, group_ids, loss_mask, cfg, episode_ids, turn)


def _turn_advantages(
    rewards: Tensor, trees: Sequence[TreePosition | None], shape: torch.Size, cfg: LossConfig
) -> Tensor | None:
    """The turn term of :func:`compute_tree_advantages`; None when no branch point has two children."""
    leaves: dict[tuple[str, tuple[int, ...]], list[int]] = {}  # node -> the rows below it
    for i, pos in enumerate(trees):
        if pos is None:
            continue
        for d in range(len(pos.path) + 1):
            leaves.setdefault((pos.tree_id, tuple(pos.path[:d])), []).append(i)
    children: dict[tuple[str, tuple[int, ...]], list[tuple[int, ...]]] = {}
    for tree_id, path in leaves:
        if path:
            children.setdefault((tree_id, path[:-1]), []).append(path)
    node_adv: dict[tuple[str, tuple[int, ...]], float] = {}
    for (tree_id, _), kids in children.items():
        if len(kids) < 2:
            continue
        means = torch.stack([rewards[leaves[(tree_id, kid)]].mean() for kid in kids])
        centered = means - means.mean()
        if cfg.advantage_estimator == "grpo" and cfg.normalize_advantage_std:
            centered = centered / (means.std(unbiased=True) + cfg.advantage_eps)
        for kid, a in zip(kids, centered.tolist(), strict=True):
            node_adv[(tree_id, kid)] = a
    if not node_adv:
        return None
    out = torch.zeros(shape, dtype=torch.float64)
    for i, pos in enumerate(trees):
        if pos is None:
            continue
        bounds = [*pos.branch_offsets, shape[1]]
        for d in range(len(pos.path)):
            a = node_adv.get((pos.tree_id, tuple(pos.path[: d + 1])))
            if a is not None:
                out[i, bounds[d] : bounds[d + 1]] = a
    return out


def _episodes(
    idx: list[int], episode_ids: Sequence[str | None] | None, rewards: Tensor
) -> tuple[list[int], list[int]]:
    """For the rows ``idx`` of one group: the first row of each episode, and each row's episode
    (an index into that list). Raises when the rows of one episode disagree on the reward."""
    if episode_ids is None:
        return idx, list(range(len(idx)))
    first: list[int] = []
    seen: dict[str, int] = {}
    of_row: list[int] = []
    for i in idx:
        key = episode_ids[i]
        if key is None:
            of_row.append(len(first))
            first.append(i)
        elif key in seen:
            j = seen[key]
            if rewards[i] != rewards[first[j]]:
                raise ValueError(
                    f"episode {key}: its rows have rewards {float(rewards[first[j]])} and {float(rewards[i])}"
                )
            of_row.append(j)
        else:
            seen[key] = len(first)
            of_row.append(len(first))
            first.append(i)
    return first, of_row


# ---- off-policy correction ------------------------------------------------------------------------
@dataclass
class MetricSums:
    """Running sums and counts of metrics; merged across micro-batches, reduced across ranks.

    Tensor values stay where they are, summed in float64, until :meth:`resolve` (or :meth:`means`) reads
    them all in one transfer: a ``float()`` per metric would make the host wait for the GPU in the middle
    of every micro-batch, so the backward's launches could not run ahead of the GPU. Float64 sums of the
    values give the same numbers as sums of their Python floats.
    """

    sums: dict[str, float | Tensor] = field(default_factory=dict)
    counts: dict[str, float | Tensor] = field(default_factory=dict)
    maxes: dict[str, float | Tensor] = field(default_factory=dict)

    def add(self, name: str, total: float | Tensor, count: float | Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + _f64(total)
        self.counts[name] = self.counts.get(name, 0.0) + _f64(count)

    def max(self, name: str, value: float | Tensor) -> None:
        value = _f64(value)
        if name not in self.maxes:
            self.maxes[name] = value
        elif isinstance(value, Tensor) or isinstance(self.maxes[name], Tensor):
            self.maxes[name] = torch.fmax(torch.as_tensor(self.maxes[name]), torch.as_tensor(value))
        else:
            self.maxes[name] = max(self.maxes[name], value)

    def resolve(self) -> None:
        """Read every tensor value to the host (one transfer per device); all values are floats after."""
        by_device: dict[torch.device, list[tuple[dict, str]]] = {}
        for d in (self.sums, self.counts, self.maxes):
            for k, v in d.items():
                if isinstance(v, Tensor):
                    by_device.setdefault(v.device, []).append((d, k))
        for group in by_device.values():
            values = torch.stack([d[k].reshape(()) for d, k in group]).cpu().tolist()
            for (d, k), v in zip(group, values, strict=True):
                d[k] = v

    def means(self) -> dict[str, float]:
        self.resolve()
        out = {k: (self.sums[k] / self.counts[k] if self.counts[k] else 0.0) for k in sorted(self.sums)}
        out.update(self.maxes)
        return out


def _f64(x: float | Tensor) -> float | Tensor:
    return x.detach().double() if isinstance(x, Tensor) else float(x)


@dataclass
class OffPolicyWeights:
    """Detached per-token IS weights and keep-mask from ρ = π_old/μ."""

    weights: Tensor  # [B, T], w (1 where no TIS)
    keep: Tensor  # [B, T] float {0, 1}: MIS / geometric rejection mask (times loss_mask)


def off_policy_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    cfg: LossConfig,
    metrics: MetricSums | None = None,
    same_version: Tensor | None = None,
) -> OffPolicyWeights:
    """TIS weights and MIS / rejection masks; logs the mismatch metrics into ``metrics``. ``same_version``
    [B, T] bool marks the tokens sampled with the weights π_old is computed with: over them the mismatch
    is the engine's and the trainer's numerics alone (``*_same_version``), where over all tokens it also
    holds the policy's lag behind the trainer."""
    mask = loss_mask.to(old_logprobs.dtype)
    with torch.no_grad():
        if cfg.off_policy == "bypass":
            log_rho = torch.zeros_like(old_logprobs)
        else:
            log_rho = (old_logprobs - rollout_logprobs) * mask
        n_tok = mask.sum()
        seq_len = mask.sum(-1)
        seq_valid = seq_len > 0
        seq_log_rho = log_rho.sum(-1)  # log Π_t ρ_t
        rho = torch.exp(log_rho)

        weights = torch.ones_like(log_rho)
        if cfg.tis == "token":
            weights = rho.clamp(max=cfg.tis_cap)
            clipped = (rho > cfg.tis_cap).to(mask.dtype) * mask
        elif cfg.tis == "sequence":
            seq_rho = torch.exp(seq_log_rho)
            weights = seq_rho.clamp(max=cfg.tis_cap)[:, None].expand_as(log_rho).clone()
            clipped = (seq_rho > cfg.tis_cap).to(mask.dtype)[:, None] * mask
        else:
            clipped = torch.zeros_like(mask)

        keep = mask.clone()
        if cfg.mis == "token":
            keep = keep * ((rho >= cfg.mis_low) & (rho <= cfg.mis_high)).to(mask.dtype)
        elif cfg.mis == "sequence":
            seq_rho = torch.exp(seq_log_rho)
            ok = (seq_rho >= cfg.mis_low) & (seq_rho <= cfg.mis_high)
            keep = keep * ok.to(mask.dtype)[:, None]
        if cfg.geo_reject_low is not None or cfg.geo_reject_high is not None:
            geo = torch.exp(seq_log_rho / seq_len.clamp(min=1))
            ok = torch.ones_like(geo, dtype=torch.bool)
            if cfg.geo_reject_low is not None:
                ok &= geo >= cfg.geo_reject_low
            if cfg.geo_reject_high is not None:
                ok &= geo <= cfg.geo_reject_high
            keep = keep * ok.to(mask.dtype)[:, None]

        if metrics is not None:
            d = (rollout_logprobs - old_logprobs) * mask  # log μ - log π_old
            if cfg.off_policy == "bypass":
                d = torch.zeros_like(d)
            metrics.add("mismatch_kl", ((torch.exp(-d) - 1 + d) * mask).sum(), n_tok)  # k3 of KL(μ‖π_old)
            metrics.add("mismatch_k1", d.sum(), n_tok)
            metrics.max("mismatch_logprob_abs_diff_max", d.abs().amax() if d.numel() else 0.0)
            if same_version is not None:
                same = mask * same_version.to(mask.dtype)
                ds = d * same
                metrics.add("mismatch_kl_same_version", ((torch.exp(-ds) - 1 + ds) * same).sum(), same.sum())
                metrics.max(
                    "mismatch_logprob_abs_diff_max_same_version", ds.abs().amax() if ds.numel() else 0.0
                )
                metrics.add("same_version_token_frac", same.sum(), n_tok)
            metrics.add("tis_clip_frac", clipped.sum(), n_tok)
            metrics.add("tis_weight_mean", (weights * mask).sum(), n_tok)
            metrics.add("masked_frac", (mask - keep).sum(), n_tok)
            metrics.add("rejected_seq_frac", (seq_valid & (keep.sum(-1) == 0)).sum(), seq_valid.sum())
    return OffPolicyWeights(weights=weights, keep=keep)


# ---- KL, aggregation ------------------------------------------------------------------------------
def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(π_θ‖π_ref) (Schulman's k1/k2/k3; low_var_kl is k3 clamped, as verl)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    if estimator == "low_var_kl":
        lr = (-log_ratio).clamp(-20, 20)
        return (torch.exp(lr) - 1 - lr).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {estimator!r}")


@dataclass(frozen=True)
class Denominators:
    """Global (mini-batch, all data-parallel ranks) counts the aggregation divides by."""

    num_tokens: float  # Σ loss_mask
    num_seqs: float  # sequences with at least one loss token


def aggregate(values: Tensor, mask: Tensor, cfg: LossConfig, denom: Denominators) -> Tensor:
    """Reduce per-token ``values`` to this micro-batch's share of the mini-batch objective."""
    m = mask.to(values.dtype)
    if cfg.aggregation == "token_mean":
        return (values * m).sum() / max(denom.num_tokens, 1.0)
    if cfg.aggregation == "seq_mean_token_mean":
        per_seq = (values * m).sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq.sum() / max(denom.num_seqs, 1.0)
    if cfg.aggregation == "token_sum":
        return (values * m).sum() / (max(denom.num_seqs, 1.0) * cfg.token_sum_norm)
    raise ValueError(f"unknown aggregation {cfg.aggregation!r}")


# ---- policy loss ----------------------------------------------------------------------------------
def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: LossConfig,
    denom: Denominators,
    rollout_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    metrics: MetricSums | None = None,
    same_version: Tensor | None = None,
) -> Tensor:
    """The micro-batch loss (already scaled by the global denominators); see the module docstring.

    ``old_logprobs`` is π_old (decoupled) — in bypass mode pass the rollout logprobs as
    ``old_logprobs``, or leave it equal to ``rollout_logprobs``. ``same_version``: see
    :func:`off_policy_weights`.
    """
    mask = loss_mask.to(logprobs.dtype)
    metrics = metrics if metrics is not None else MetricSums()
    n_tok = mask.sum()

    if cfg.mode == "sft":
        nll = -logprobs
        loss = aggregate(nll, mask, cfg, denom)
        metrics.add("sft_nll", (nll.detach() * mask).sum(), n_tok)
        if entropy is not None:
            metrics.add("entropy", (entropy.detach() * mask).sum(), n_tok)
        return loss

    if cfg.off_policy == "bypass" and rollout_logprobs is not None:
        old_logprobs = rollout_logprobs
    mu = rollout_logprobs if rollout_logprobs is not None else old_logprobs
    opw = off_policy_weights(old_logprobs, mu, loss_mask, cfg, metrics, same_version)
    keep = opw.keep

    log_ratio = (logprobs - old_logprobs) * mask
    if cfg.mode == "gspo":
        seq_lr = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
        # value = sequence ratio, gradient = seq ratio · ∇log π_θ(token) (GSPO-token form)
        log_ratio = logprobs - logprobs.detach() + seq_lr.detach()[:, None]
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high)
    pg1 = -advantages * ratio
    pg2 = -advantages * clipped_ratio
    pg = torch.maximum(pg1, pg2)
    if cfg.dual_clip is not None:
        pg3 = -advantages * cfg.dual_clip
        dual = (advantages < 0) & (pg > pg3)
        pg = torch.where(advantages < 0, torch.minimum(pg, pg3), pg)
    else:
        dual = torch.zeros_like(mask, dtype=torch.bool)
    per_token = pg * opw.weights
    loss = aggregate(per_token, keep, cfg, denom)

    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * aggregate(kl, mask, cfg, denom)
        metrics.add("ref_kl", (kl.detach() * mask).sum(), n_tok)
    if entropy is not None:
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg, denom)
        metrics.add("entropy", (entropy.detach() * mask).sum(), n_tok)

    with torch.no_grad():
        lr_tok = (logprobs - old_logprobs) * mask
        metrics.add("ppo_kl", (-lr_tok).sum(), n_tok)  # k1 of KL(π_old‖π_θ); exactly 0 at the first step
        metrics.add("ppo_clip_frac", ((pg2 > pg1).to(mask.dtype) * mask).sum(), n_tok)
        metrics.add(
            "ppo_clip_frac_low",
            ((ratio < 1 - cfg.eps_clip_low) & (advantages < 0)).to(mask.dtype).mul(mask).sum(),
            n_tok,
        )
        metrics.add(
            "ppo_clip_frac_high",
            ((ratio > 1 + cfg.eps_clip_high) & (advantages > 0)).to(mask.dtype).mul(mask).sum(),
            n_tok,
        )
        metrics.add("dual_clip_frac", (dual.to(mask.dtype) * mask).sum(), n_tok)
        metrics.add("ratio_mean", (ratio.detach() * mask).sum(), n_tok)
        metrics.add("pg_loss", (pg.detach() * opw.weights * keep).sum(), keep.sum())
        metrics.add("advantage_mean", (advantages * mask).sum(), n_tok)
    return loss


def sequence_denominators(loss_mask: Tensor) -> Denominators:
    """Denominators of a batch held in one tensor (single process, no accumulation)."""
    m = loss_mask.to(torch.float64)
    return Denominators(num_tokens=float(m.sum()), num_seqs=float((m.sum(-1) > 0).sum()))
