"""Batch preparation of the train step, pure torch on CPU (no torch.distributed): which trajectories are
trained on, their per-token advantages, and the plan of mini-batches (one optimizer step each) made of
right-padded micro-batches (one forward/backward each) for one data-parallel rank.

**Packing** (``pack=True``): a micro-batch is filled up to a budget of *real* tokens, and its model input
is its sequences laid end to end (:class:`PackedTokens`, attention within each sequence only), so no
compute is spent on padding. The loss side keeps the padded ``[b, s]`` layout: the packed logprobs are
put back into it (:attr:`PackedTokens.index`), so every loss and metric reads the same tensors either
way."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from agentrl.trainer.losses import Denominators, LossConfig, compute_advantages, compute_tree_advantages
from agentrl.types import Status, Trajectory


@dataclass
class PackedTokens:
    """A micro-batch's sequences end to end, ``[1, t]``: sequence ``i`` is ``[cu_seqlens[i],
    cu_seqlens[i+1])``; ``index[j]`` is packed position ``j``'s place in the padded layout (row * s + col)."""

    tokens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    index: torch.Tensor

    def unpack(self, rows: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """``rows`` [t, ...] (one per packed position) in the padded layout ``shape`` = (b, s): [b, s, ...],
        zeros where no packed position falls."""
        grid = rows.new_zeros(shape[0] * shape[1], *rows.shape[1:])
        return grid.index_copy(0, self.index, rows).view(*shape, *rows.shape[1:])

    def to(self, device: torch.device) -> PackedTokens:
        return PackedTokens(
            self.tokens.to(device, non_blocking=True),
            self.targets.to(device, non_blocking=True),
            self.positions.to(device, non_blocking=True),
            self.cu_seqlens.to(device, non_blocking=True),
            self.max_seqlen,
            self.index.to(device, non_blocking=True),
        )


@dataclass
class MicroBatch:
    """Right-padded ``[b, s]`` tensors over input positions; index ``i`` predicts token ``i + 1``."""

    tokens: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    traj_index: list[int]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    packed: PackedTokens | None = None  # the model input, when packed
    routed_experts: torch.Tensor | None = None  # MoE routing replay: [b, s, layers, k] int, -1 = none
    padding_mask: torch.Tensor | None = None  # MoE: [b, s] True at padding (left out of the balancing loss)
    versions: torch.Tensor | None = None  # [b, s] int: the policy version of each target token, -1 elsewhere

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def to(self, device: torch.device) -> MicroBatch:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return MicroBatch(
            mv(self.tokens),
            mv(self.targets),
            mv(self.loss_mask),
            mv(self.rollout_logprobs),
            mv(self.advantages),
            self.traj_index,
            mv(self.old_logprobs),
            mv(self.ref_logprobs),
            None if self.packed is None else self.packed.to(device),
            mv(self.routed_experts),
            mv(self.padding_mask),
            mv(self.versions),
        )  # type: ignore[arg-type]


@dataclass
class MiniBatch:
    """One optimizer step's share of this rank: its micro-batches and the global (all data-parallel
    ranks) counts the loss of the whole mini-batch divides by."""

    denom: Denominators
    micro_batches: list[MicroBatch]


def input_length(t: Trajectory) -> int:
    """Input positions of a trajectory: every token but the last (which is only ever a target)."""
    return len(t.prompt_ids) + len(t.response_ids) - 1


def response_logprobs(lp: torch.Tensor, row: int, t: Trajectory) -> list[float]:
    """``t``'s response tokens in row ``row`` of a micro-batch's logprobs ``[b, s]`` (position ``i`` holds
    the logprob of token ``i + 1``)."""
    p, r = len(t.prompt_ids), len(t.response_ids)
    return lp[row, p - 1 : p - 1 + r].tolist()


def recorded_by_position(
    trajectories: list[Trajectory], usable: list[Trajectory], recorded: list[tuple[MicroBatch, torch.Tensor]]
) -> dict[int, list[float]]:
    """The logprobs a step recorded for its micro-batches (rows index ``usable``), as each trajectory's
    response-token logprobs keyed by its position in ``trajectories``, the batch ``usable`` came from."""
    position = {id(t): i for i, t in enumerate(trajectories)}
    out: dict[int, list[float]] = {}
    for mb, lp in recorded:
        lp = lp.float().cpu()
        for row, i in enumerate(mb.traj_index):
            out[position[id(usable[i])]] = response_logprobs(lp, row, usable[i])
    return out


def select_usable(trajectories: list[Trajectory], sft: bool = False) -> tuple[list[Trajectory], int]:
    """The trajectories a step trains on, validated, and how many were dropped: failed ones, ones with
    an empty prompt and, unless ``sft``, unrewarded ones. Raises ``ValueError`` when none is usable."""
    usable = [
        t
        for t in trajectories
        if t.status != Status.FAILED and len(t.prompt_ids) >= 1 and (t.reward is not None or sft)
    ]
    dropped = len(trajectories) - len(usable)
    if not usable:
        raise ValueError(f"train_step got no usable trajectory ({dropped} failed or unrewarded)")
    for t in usable:
        t.validate()
    return usable, dropped


def response_mask(trajs: list[Trajectory]) -> torch.Tensor:
    """``[n, longest response]`` loss masks, zero-padded (at least one column)."""
    rmax = max(1, max(len(t.response_ids) for t in trajs))
    mask = torch.zeros(len(trajs), rmax)
    for i, t in enumerate(trajs):
        mask[i, : len(t.response_ids)] = torch.tensor(t.loss_mask, dtype=torch.float32)
    return mask


def batch_advantages(trajs: list[Trajectory], resp_mask: torch.Tensor, cfg: LossConfig) -> list[torch.Tensor]:
    """Per-response-token advantages over the whole batch (groups by ``group_id``, each episode counted
    once: rows sharing an ``episode_id`` share one advantage; tree-rollout leaves also get each turn's
    advantage against its siblings, :func:`~agentrl.trainer.losses.compute_tree_advantages`); zeros in
    SFT mode."""
    if cfg.mode == "sft":
        adv = torch.zeros_like(resp_mask)
    else:
        rewards = torch.tensor([float(t.reward) for t in trajs])  # type: ignore[arg-type]
        if any(t.tree is not None for t in trajs):  # tree rollouts: per-turn advantages too
            trees = [t.tree for t in trajs]
            adv = compute_tree_advantages(rewards, [t.group_id for t in trajs], resp_mask, cfg, trees)
        else:
            adv = compute_advantages(
                rewards, [t.group_id for t in trajs], resp_mask, cfg, [t.episode_id for t in trajs]
            )
    return [adv[i, : len(t.response_ids)] for i, t in enumerate(trajs)]


def make_micro_batch(
    trajs: list[Trajectory],
    index: list[int],
    advantages: list[torch.Tensor],
    pad_id: int = 0,
    seq_len: int | None = None,
    num_rows: int | None = None,
    pack: bool = False,
) -> MicroBatch:
    """Trajectories ``index`` as one right-padded micro-batch (``advantages[i]``: per response token);
    with ``pack`` its model input is also laid end to end (:class:`PackedTokens`)."""
    lengths = [input_length(trajs[i]) for i in index]
    s = max(lengths) if seq_len is None else seq_len
    b = len(index) if num_rows is None else num_rows
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    targets = torch.full((b, s), pad_id, dtype=torch.long)
    mask = torch.zeros(b, s)
    mu = torch.zeros(b, s)
    adv = torch.zeros(b, s)
    versions = torch.full((b, s), -1, dtype=torch.long)
    for row, i in enumerate(index):
        t = trajs[i]
        full = t.prompt_ids + t.response_ids
        n = len(full) - 1
        p = len(t.prompt_ids)
        r = len(t.response_ids)
        tokens[row, :n] = torch.tensor(full[:-1])
        targets[row, :n] = torch.tensor(full[1:])
        mask[row, p - 1 : p - 1 + r] = torch.tensor(t.loss_mask, dtype=torch.float32)
        mu[row, p - 1 : p - 1 + r] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
        adv[row, p - 1 : p - 1 + r] = advantages[i]
        if len(t.policy_versions) == r:
            versions[row, p - 1 : p - 1 + r] = torch.tensor(t.policy_versions, dtype=torch.long)
    mu = mu * mask
    mb = MicroBatch(tokens, targets, mask, mu, adv * mask, list(index), versions=versions)
    if pack:
        ar = [torch.arange(n) for n in lengths]
        mb.packed = PackedTokens(
            tokens=torch.cat([tokens[row, :n] for row, n in enumerate(lengths)])[None],
            targets=torch.cat([targets[row, :n] for row, n in enumerate(lengths)])[None],
            positions=torch.cat(ar)[None],
            cu_seqlens=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
            max_seqlen=max(lengths),
            index=torch.cat([row * s + a for row, a in enumerate(ar)]),
        )
    return mb


def split_micro_batches(
    lengths: list[int], micro_batch_size: int, max_tokens: int | None, pack: bool = False
) -> list[list[int]]:
    """Positions grouped into micro-batches, in order: ``micro_batch_size`` sequences each, or (with
    ``max_tokens``) as many as fit ``rows x longest <= max_tokens`` -- with ``pack``, as many as fit
    ``sum of lengths <= max_tokens`` (a longer sequence goes alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    longest = total = 0
    for i, n in enumerate(lengths):
        if max_tokens is None:
            if len(cur) == micro_batch_size:
                out.append(cur)
                cur = []
        elif cur and (total + n if pack else (len(cur) + 1) * max(longest, n)) > max_tokens:
            out.append(cur)
            cur, longest, total = [], 0, 0
        cur.append(i)
        longest = max(longest, n)
        total += n
    if cur:
        out.append(cur)
    return out


def plan_mini_batches(
    trajs: list[Trajectory],
    advantages: list[torch.Tensor],
    resp_mask: torch.Tensor,
    num_mini_batches: int,
    micro_batch_size: int,
    max_tokens_per_micro_batch: int | None = None,
    dp_rank: int = 0,
    dp_size: int = 1,
    pad_id: int = 0,
    fixed_shape: bool = False,
    pack: bool = False,
    same_shape_across_ranks: bool = False,
) -> list[MiniBatch]:
    """Split the batch, in order, into ``num_mini_batches`` contiguous mini-batches (fewer when the batch
    is smaller), take data-parallel rank ``dp_rank``'s strided share of each and pack it into
    micro-batches (:func:`split_micro_batches`). The denominators count the whole mini-batch, every rank's
    share. ``fixed_shape`` (pipeline parallelism's fixed p2p shapes): every micro-batch of a mini-batch
    gets the same length and ``micro_batch_size`` rows. ``pack``: packed micro-batches (module docstring).
    ``same_shape_across_ranks`` (MoE expert parallelism, whose token all-gather needs equal shapes on every
    rank): every rank's micro-batches get the mini-batch's longest length and ``micro_batch_size`` rows, and
    each rank as many micro-batches (a rank with fewer sequences gets empty ones, all loss mask 0)."""
    n = len(trajs)
    k = min(num_mini_batches, n)
    bounds = [round(j * n / k) for j in range(k + 1)]
    plan: list[MiniBatch] = []
    for j in range(k):
        mini = list(range(bounds[j], bounds[j + 1]))
        m = resp_mask[mini]
        denom = Denominators(num_tokens=float(m.sum()), num_seqs=float((m.sum(-1) > 0).sum()))
        local = mini[dp_rank::dp_size]
        lengths = [input_length(trajs[i]) for i in local]
        groups = split_micro_batches(lengths, micro_batch_size, max_tokens_per_micro_batch, pack)
        if same_shape_across_ranks:
            seq = max(input_length(trajs[i]) for i in mini)
            per_rank = -(-len(mini) // dp_size)  # the largest rank share
            count = -(-per_rank // micro_batch_size)
            mbs = [
                make_micro_batch(trajs, [local[g] for g in grp], advantages, pad_id, seq, micro_batch_size)
                for grp in groups
            ]
            mbs += [
                make_micro_batch(trajs, [], advantages, pad_id, seq, micro_batch_size)
                for _ in range(count - len(mbs))
            ]
        elif fixed_shape:
            seq = max(lengths) if lengths else 1
            mbs = [
                make_micro_batch(trajs, [local[g] for g in grp], advantages, pad_id, seq, micro_batch_size)
                for grp in groups
            ]
        else:
            mbs = [
                make_micro_batch(trajs, [local[g] for g in grp], advantages, pad_id, pack=pack)
                for grp in groups
            ]
        plan.append(MiniBatch(denom, mbs))
    return plan
