"""RolloutConfig: every knob of the orchestrator, validated (see agentrl.rollout for what they drive)."""

from __future__ import annotations

import itertools
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from agentrl.config import ConfigModel
from agentrl.engine.types import SamplingParams
from agentrl.episodes import DumpConfig


class TreeConfig(ConfigModel):
    """Tree rollouts (:mod:`agentrl.rollout.tree`): each of a group's ``group_size`` episodes grows into a
    tree. After each model turn of ``branch_at`` (and its observation) the episode forks into ``k``
    children that share its tokens; a tree has up to ``k ** len(branch_at)`` leaves, each a trajectory.
    With ``fill`` an episode that ends before its next branch point is sampled again from where it
    started, so that the tree keeps its ``k ** len(branch_at)`` leaves."""

    branch_at: list[int] = Field(
        description="model turns (1-based, ascending) after which an episode branches; [] never branches"
    )
    k: int = Field(2, ge=1, description="children of each branch point (1: the tree is one flat episode)")
    fill: bool = Field(
        True,
        description="an episode that completes or is truncated before its next branch point is sampled "
        "again from where it started (the task, or its parent's branch point), as a sibling of it, until "
        "the tree has k ** len(branch_at) leaves; costs a spare env (a fork, held while the children play) "
        "at each branch point of every turn in branch_at but the last. false: such an episode is a leaf "
        "and the tree has fewer leaves",
    )

    @model_validator(mode="after")
    def _check(self) -> TreeConfig:
        turns = self.branch_at
        if any(t < 1 for t in turns) or any(b <= a for a, b in itertools.pairwise(turns)):
            raise ValueError(f"rollout.tree.branch_at: model turns 1, 2, ... in ascending order, not {turns}")
        if self.leaves > MAX_TREE_LEAVES:
            raise ValueError(
                f"rollout.tree: k ** len(branch_at) = {self.leaves} leaves a tree, "
                f"more than {MAX_TREE_LEAVES}"
            )
        return self

    @property
    def leaves(self) -> int:
        """Leaves of a tree whose episodes reach every branch point."""
        return self.k ** len(self.branch_at)


MAX_TREE_LEAVES = 1024


class RolloutConfig(ConfigModel):
    """Group sampling, staleness, episode limits, filtering, failure handling and resume behaviour."""

    replaced_fields: ClassVar[dict[str, str]] = {"deterministic": "the run's top-level deterministic switch"}

    # ---- groups and staleness ----------------------------------------------------------------------
    group_size: int = Field(8, ge=1, description="samples per task (GRPO group size n)")
    batch_size: int = Field(
        32, ge=1, description="groups the trainer consumes per step (B); one version bump per step"
    )
    max_staleness: int = Field(
        1, ge=0, description="η: a trained token is at most this many versions old (0 = on-policy)"
    )
    max_concurrency: int = Field(256, ge=1, description="episodes (not groups) in flight at most")
    shards: int = Field(
        1,
        ge=1,
        description="orchestrators the rollout runs as, each a process (Ray actor) with its own event loop "
        "(agentrl.rollout.shards): shard i drives engines i*k .. (i+1)*k-1 (k = engines / shards), trains "
        "on tasks i, i+shards, ..., with batch_size / shards groups a batch, max_concurrency / shards "
        "episodes in flight and seed + i; one batch is every shard's, in shard order. More than 1 when one "
        "event loop saturates (rollout/loop_busy_frac near 1) before the engines do",
    )
    over_sampling: float = Field(
        1.0,
        ge=1.0,
        description="run up to (over_sampling-1)*batch_size extra groups beyond "
        "the admission bound, so that filtered groups are replaced sooner; a "
        "surplus group that would be too stale is re-run, never trained",
    )
    # ---- episodes --------------------------------------------------------------------------------------
    max_turns: int = Field(8, ge=1, description="model turns per episode at most (then status truncated)")
    max_total_tokens: int = Field(4096, ge=2, description="prompt + response tokens at most (then truncated)")
    max_context_length: int | None = Field(
        None, ge=2, description="the model's context length, if smaller than max_total_tokens"
    )
    sampling: SamplingParams = Field(
        default_factory=lambda: SamplingParams(temperature=1.0, max_new_tokens=512),
        description="sampling params for rollouts; max_new_tokens "
        "is the per-turn limit; env stop strings are added",
    )
    eval_sampling: SamplingParams = Field(
        default_factory=lambda: SamplingParams(temperature=0.0, max_new_tokens=512),
        description="sampling params for evaluate() (greedy by default)",
    )
    verifier: str | None = Field(
        None,
        description="registered verifier scoring an episode "
        "when the env gave no reward; unset: the env's own",
    )
    verifier_timeout: float = Field(30.0, gt=0, description="seconds a verifier may take")
    env_step_timeout: float | None = Field(
        None, gt=0, description="seconds one env.step / env.reset may take (None: no limit)"
    )
    # ---- filtering -------------------------------------------------------------------------------------
    filter_zero_variance: bool = Field(
        True, description="drop groups whose rewards are all equal (no GRPO signal)"
    )
    failed_member_policy: Literal["drop_group", "drop_member"] = Field(
        "drop_group",
        description="a group with a member that failed after its retries: drop it whole "
        "(reason 'failed:<kind>', counted in rollout/dropped_groups/failed:<kind>, the "
        "error logged), or train the rest (drop_member)",
    )
    min_group_size: int = Field(
        1, ge=1, description="with drop_member: drop the group when fewer members remain"
    )
    # ---- failures and retries -------------------------------------------------------------------------
    max_retries: int = Field(
        2,
        ge=0,
        description="re-runs of a failed episode (env, tool, verifier or engine error), each with "
        "a fresh env (counted in rollout/retries); then failed_member_policy decides its group",
    )
    engine_retries: int = Field(
        8, ge=0, description="re-sends of one /generate after engine errors, before the episode fails"
    )
    engine_retry_backoff: float = Field(
        0.25, ge=0, description="first backoff (s) between engine re-sends; doubles, capped at 4 s"
    )
    no_progress_groups: int | None = Field(
        None,
        ge=0,
        description="stop the run (NoProgressError from get_batch, naming the cause) once this "
        "many groups in a row were dropped (zero variance, failed, stale) and none kept; None: "
        "a whole pass over the dataset, at most 1000 and at least 2 * batch_size; 0: never",
    )
    no_progress_failures: int | None = Field(
        None,
        ge=0,
        description="stop the run (NoProgressError) once this many episodes in a row "
        "failed after their retries, or this many tool calls in a row failed, with "
        "none succeeding between; None: max(32, 2 * batch_size * group_size); 0: never",
    )
    max_stale_restarts: int = Field(
        3,
        ge=0,
        description="re-runs of an episode, or re-queues of a finished group, that would be too "
        "stale to train; beyond it the episode fails / the group is dropped (reason 'stale')",
    )
    # ---- weight updates ---------------------------------------------------------------------------------
    interrupt_mode: Literal["continue", "restart"] = Field(
        "continue",
        description="an episode interrupted by a weight update: resubmit its tokens and "
        "continue under the new version (mixed versions), or restart it from scratch",
    )
    pause_timeout: float = Field(
        60.0, gt=0, description="seconds pause_for_update waits for in-flight requests to return"
    )
    # ---- dataset ----------------------------------------------------------------------------------------
    shuffle: bool = Field(
        True, description="shuffle tasks per epoch (when the orchestrator wraps a plain task list)"
    )
    epochs: int | None = Field(None, ge=1, description="passes over the dataset (None: cycle forever)")
    seed: int = Field(
        0, description="shuffle seed; in a deterministic run, also the base of the request seeds"
    )
    record_outcomes: bool = Field(False, description="keep a per-draw outcome log (tests, audits)")
    return_routed_experts: bool = Field(
        False,
        description="MoE models: ask the engine for each token's routed experts (SGLang's "
        "return_routed_experts; an SGLang server needs --enable-return-routed-experts) and keep "
        "them in the trajectory for routing replay; on by itself when trainer.moe.routing_replay is",
    )
    tree: TreeConfig | None = Field(
        None,
        description="tree rollouts: {branch_at: [turns], k: children}; each group member grows into a tree "
        "whose leaves are its trajectories, and each turn's advantage compares it with its siblings "
        "(agentrl.rollout.tree; the env must fork, agentrl.envs.fork); None: flat episodes",
    )
    dump: DumpConfig = Field(
        default_factory=DumpConfig,
        description="write trained and evaluated trajectories to <output_dir>/trajectories "
        "(agentrl.episodes): all, off, every N steps, or {every: N, eval: bool}",
    )

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.group_size > self.max_concurrency:
            raise ValueError(
                f"group_size ({self.group_size}) must not exceed max_concurrency ({self.max_concurrency})"
            )
        if self.tree is not None:
            if self.tree.branch_at and self.tree.branch_at[-1] >= self.max_turns:
                raise ValueError(
                    f"rollout.tree.branch_at: turn {self.tree.branch_at[-1]} is not before the last turn an "
                    f"episode may take (rollout.max_turns = {self.max_turns}); it would never branch"
                )
            if self.group_episodes > self.max_concurrency:
                raise ValueError(
                    f"rollout.tree: a group grows up to group_size * k ** len(branch_at) = "
                    f"{self.group_episodes} episodes at once, more than "
                    f"max_concurrency ({self.max_concurrency})"
                )
        if self.min_group_size > self.group_size:
            raise ValueError("min_group_size must not exceed group_size")
        return self

    def check_shards(self) -> None:
        """A ValueError naming the fields when the work cannot be split evenly over ``shards`` orchestrators:
        ``batch_size`` must divide, and each shard's share of ``max_concurrency`` must hold a group."""
        n = self.shards
        if self.batch_size % n:
            raise ValueError(
                f"rollout.batch_size: {self.batch_size} groups cannot be split evenly over rollout.shards = "
                f"{n} orchestrators (each forms batch_size / shards groups of every batch)"
            )
        if self.max_concurrency // n < self.group_episodes:
            what = (
                f"rollout.group_size = {self.group_size}"
                if self.tree is None
                else f"a group's {self.group_episodes} episodes (rollout.group_size times a tree's leaves)"
            )
            raise ValueError(
                f"rollout.max_concurrency: {self.max_concurrency} episodes split over rollout.shards = {n} "
                f"leave {self.max_concurrency // n} a shard, fewer than {what} (a group runs on one shard); "
                "raise max_concurrency or lower shards"
            )

    @property
    def group_episodes(self) -> int:
        """Episodes a group runs at once at most: ``group_size``, times a tree's leaves in tree rollouts."""
        return self.group_size * (self.tree.leaves if self.tree is not None else 1)

    @property
    def token_limit(self) -> int:
        return min(self.max_total_tokens, self.max_context_length or self.max_total_tokens)

    @property
    def extra_running_groups(self) -> int:
        return round((self.over_sampling - 1.0) * self.batch_size)
