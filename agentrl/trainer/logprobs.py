"""Token logprobs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for the vocabulary rows ``[vocab_start, vocab_start + V_local)``
(the last rank may hold padding rows past the true vocabulary; they are cut off here). Forward all-reduces
three small ``[N]`` tensors (max, Σexp, target logit, Σp·logit); backward is local, because every TP rank
computes the same loss from the same reduced values (an autograd all-reduce would count the gradient
``tp`` times). With no group (TP = 1) it is an ordinary log-softmax.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def _all_reduce(t: Tensor, op: Any, group: Any) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, target: Tensor, vocab_start: int, group: Any
    ) -> tuple[Tensor, Tensor]:
        # logits [N, V_local] fp32, target [N] global ids
        m = logits.max(dim=-1).values
        _all_reduce(m, dist.ReduceOp.MAX, group)
        shifted = logits - m[:, None]
        e = shifted.exp()
        s = _all_reduce(e.sum(-1), dist.ReduceOp.SUM, group)
        local = target - vocab_start
        inside = (local >= 0) & (local < logits.shape[-1])
        idx = local.clamp(0, logits.shape[-1] - 1)
        tgt = torch.where(inside, shifted.gather(-1, idx[:, None]).squeeze(-1), torch.zeros_like(m))
        _all_reduce(tgt, dist.ReduceOp.SUM, group)
        log_s = s.log()
        logprob = tgt - log_s
        p = e / s[:, None]
        mean_shifted = _all_reduce((p * shifted).sum(-1), dist.ReduceOp.SUM, group)
        entropy = log_s - mean_shifted
        ctx.save_for_backward(p, shifted, mean_shifted, idx, inside)
        return logprob, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor, g_ent: Tensor) -> tuple[Tensor | None, ...]:
        p, shifted, mean_shifted, idx, inside = ctx.saved_tensors
        # d logprob / d l_j = 1[j = target] - p_j ;  d H / d l_j = -p_j (l_j - E_p[l])
        grad = -p * g_lp[:, None]
        grad.scatter_add_(-1, idx[:, None], (g_lp * inside.to(grad.dtype))[:, None])
        grad -= g_ent[:, None] * p * (shifted - mean_shifted[:, None])
        return grad, None, None, None


def vocab_parallel_logprobs(
    logits: Tensor,
    target: Tensor,
    true_vocab_size: int,
    tp_rank: int = 0,
    tp_group: Any = None,
) -> tuple[Tensor, Tensor]:
    """``(logprob of target, entropy)`` with the shape of ``target``; ``logits`` is ``[..., V_local]``.

    Computation is in fp32 whatever the logits' dtype.
    """
    v_local = logits.shape[-1]
    vocab_start = tp_rank * v_local
    valid = max(0, min(v_local, true_vocab_size - vocab_start))
    lg = (
        logits[..., :valid].float().reshape(-1, valid)
        if valid < v_local
        else logits.float().reshape(-1, v_local)
    )
    if valid == 0:
        raise ValueError(
            f"TP rank {tp_rank} holds only vocabulary padding; lower make_vocab_size_divisible_by"
        )
    lp, ent = _VocabParallelLogprobs.apply(lg, target.reshape(-1), vocab_start, tp_group)
    return lp.reshape(target.shape), ent.reshape(target.shape)


class ModelLogprobs:
    """Per-token ``(logprob, entropy)`` of a GPT model on right-padded ``tokens`` / ``targets``, with
    the vocabulary split over this rank's tensor-parallel group."""

    def __init__(self, vocab_size: int, tp_rank: int = 0, tp_group: Any = None) -> None:
        self.vocab_size = vocab_size
        self.tp_rank = tp_rank
        self.tp_group = tp_group

    def from_logits(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        return vocab_parallel_logprobs(logits, targets, self.vocab_size, self.tp_rank, self.tp_group)

    def __call__(self, model: torch.nn.Module, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """One forward of ``model`` (positions ``0..s-1`` on every row, no attention mask: causal)."""
        return self.from_logits(model(tokens, position_ids(tokens), None), targets)


def position_ids(tokens: Tensor) -> Tensor:
    """``[b, s]`` positions ``0..s-1`` on every row of right-padded ``tokens``."""
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
