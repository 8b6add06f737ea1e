"""How advantages and the policy loss are computed (:class:`LossConfig`, ``trainer.loss`` of a run), apart
from the computation (:mod:`agentrl.trainer.losses`), so that a run's config loads without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from agentrl.config import ConfigModel

__all__ = ["LossConfig"]


class LossConfig(ConfigModel):
    """How advantages and the policy loss are computed."""

    mode: Literal["ppo", "gspo", "sft"] = Field(
        "ppo",
        description="ppo: token-ratio clipped surrogate; gspo: "
        "sequence-ratio; sft: cross entropy on loss_mask tokens",
    )
    advantage_estimator: Literal["grpo", "dr_grpo", "reinforce_pp_baseline"] = Field(
        "grpo",
        description="grpo: (r - group mean) [/ group std]; dr_grpo: r - group mean; reinforce_pp_baseline: "
        "r - group mean, then whitened over all tokens of the batch",
    )
    normalize_advantage_std: bool = Field(True, description="grpo: divide by the group's reward std")
    advantage_eps: float = Field(1e-6, gt=0, description="added to std denominators")
    eps_clip_low: float = Field(0.2, ge=0, description="lower clip: ratio >= 1 - eps_clip_low")
    eps_clip_high: float = Field(
        0.28, ge=0, description="upper clip: ratio <= 1 + eps_clip_high (asymmetric, DAPO)"
    )
    dual_clip: float | None = Field(
        None, gt=1.0, description="dual-clip constant c (> 1) for negative advantages; None = off"
    )
    aggregation: Literal["token_mean", "seq_mean_token_mean", "token_sum"] = Field(
        "token_mean", description="how per-token losses are reduced (see module docstring)"
    )
    token_sum_norm: float = Field(
        1.0, gt=0, description="token_sum: constant divisor per sequence (Dr.GRPO: max response length)"
    )
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus coefficient (0 = off)")
    kl_coef: float = Field(
        0.0, ge=0, description="KL(π_θ‖π_ref) loss coefficient (0 = off; > 0 builds a reference model)"
    )
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "low_var_kl", description="KL estimator for the reference KL"
    )
    off_policy: Literal["decoupled", "bypass"] = Field(
        "decoupled",
        description="decoupled: recompute π_old and correct π_old/μ; bypass: π_old := μ (no recompute)",
    )
    tis: Literal["none", "token", "sequence"] = Field(
        "token", description="truncated importance sampling on ρ = π_old/μ"
    )
    tis_cap: float = Field(2.0, gt=0, description="TIS cap C in min(ρ, C)")
    mis: Literal["none", "token", "sequence"] = Field(
        "none",
        description="masked importance sampling (IcePop): drop "
        "tokens / sequences whose ρ leaves [mis_low, mis_high]",
    )
    mis_low: float = Field(0.5, ge=0, description="MIS lower bound α")
    mis_high: float = Field(2.0, gt=0, description="MIS upper bound β")
    geo_reject_low: float | None = Field(
        None, ge=0, description="reject sequences with exp(mean log ρ) below this (None = off)"
    )
    geo_reject_high: float | None = Field(
        None, gt=0, description="reject sequences with exp(mean log ρ) above this (None = off)"
    )

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.mis_low >= self.mis_high:
            raise ValueError("mis_low must be below mis_high")
        if self.eps_clip_low >= 1.0:
            raise ValueError("eps_clip_low must be < 1")
        return self
