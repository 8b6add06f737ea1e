"""Token logprobs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for the vocabulary rows ``[vocab_start, vocab_start + V_local)``
(the last rank may hold padding rows past the true vocabulary; they are cut off here). Forward reads the
logits twice (row max, then Σexp, the target's logit and Σexp·logit in one pass) and all-reduces ``[N]``
and ``[3, N]``; it keeps three fp32 numbers per token, never the softmax. Backward recomputes the softmax
from the logits and those numbers; it is local, because every TP rank computes the same loss from the same
reduced values (an autograd all-reduce would count the gradient ``tp`` times). With no group (TP = 1) it
is an ordinary log-softmax. The three local functions are plain tensor code; with ``compiled`` (the
trainer's ``compile_kernels``, on CUDA by default) torch.compile fuses each into a kernel or two, so the
fp32 math runs in registers over the bf16 logits.

**Chunked head** (:class:`ModelLogprobs` with ``chunk_tokens``): the model returns its final hidden
states instead of logits, and :class:`_ChunkedHeadLogprobs` applies the LM head ``chunk_tokens`` tokens at
a time; backward recomputes each chunk's logits. No
``[tokens, vocabulary]`` fp32 tensor lives longer than one chunk (the 151k-vocabulary logits of one
micro-batch of 4 x 1k tokens are 2.5 GB per fp32 copy), for one extra LM-head matmul per chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def _all_reduce(t: Tensor, op: Any, group: Any) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


# ---- the local math: plain tensor functions, fused by torch.compile when ``compiled`` ----------------
# Each reads one chunk of logits (any float dtype) and computes in fp32, so no fp32 [N, V] copy, no
# softmax and no shifted logits are ever stored; backward recomputes them from the three row statistics.
def _row_max(logits: Tensor) -> Tensor:
    return logits.float().amax(dim=-1)


def _exp_sums(logits: Tensor, m: Tensor, idx: Tensor, inside: Tensor) -> Tensor:
    """``[3, N]``: Σ exp(l - m), the target's l - m (0 where this rank does not hold it),
    Σ exp(l - m)(l - m)."""
    shifted = logits.float() - m[:, None]
    e = shifted.exp()
    tgt = torch.where(inside, shifted.gather(-1, idx[:, None]).squeeze(-1), 0.0)
    return torch.stack([e.sum(-1), tgt, (e * shifted).sum(-1)])


def _logits_grad(
    logits: Tensor,
    m: Tensor,
    log_s: Tensor,
    mean_shifted: Tensor,
    idx: Tensor,
    inside: Tensor,
    g_lp: Tensor,
    g_ent: Tensor,
) -> Tensor:
    """Gradient w.r.t. ``logits`` (in their dtype) of ``g_lp · logprob + g_ent · entropy``. Local: every TP
    rank computes the same loss from the same reduced statistics."""
    # d logprob / d l_j = 1[j = target] - p_j ;  d H / d l_j = -p_j (l_j - E_p[l])
    shifted = logits.float() - m[:, None]
    p = (shifted - log_s[:, None]).exp()
    cols = torch.arange(logits.shape[-1], device=logits.device)
    hit = (cols[None, :] == idx[:, None]) & inside[:, None]
    grad = torch.where(hit, g_lp[:, None], 0.0) - p * (
        g_lp[:, None] + g_ent[:, None] * (shifted - mean_shifted[:, None])
    )
    return grad.to(logits.dtype)


_KERNELS = {f.__name__: f for f in (_row_max, _exp_sums, _logits_grad)}
_COMPILED: dict[str, Any] = {}


def _kernel(name: str, compiled: bool) -> Any:
    """The local function ``name``, compiled once per process when asked. The token count goes dynamic when
    it first changes (chunks vary); the vocabulary size stays a constant, so the [N, V] kernels index
    without integer divisions by a runtime size (those made the logits gradient 2.9x slower on an H100)."""
    if not compiled:
        return _KERNELS[name]
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(_KERNELS[name])
    return _COMPILED[name]


def _target_index(target: Tensor, vocab_start: int, v_local: int) -> tuple[Tensor, Tensor]:
    """This rank's (clamped) column of each target, and whether the rank holds it."""
    local = target - vocab_start
    return local.clamp(0, v_local - 1), (local >= 0) & (local < v_local)


def _softmax_stats(
    logits: Tensor, idx: Tensor, inside: Tensor, group: Any, compiled: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(row max, log Σexp, target logit - max, E_p[logit - max])`` of ``logits`` [N, V_local] (this rank's
    vocabulary columns), reduced over the TP group: a MAX all-reduce of ``[N]`` and a SUM of ``[3, N]``."""
    m = _all_reduce(_kernel("_row_max", compiled)(logits), dist.ReduceOp.MAX, group)
    sums = _all_reduce(_kernel("_exp_sums", compiled)(logits, m, idx, inside), dist.ReduceOp.SUM, group)
    return m, sums[0].log(), sums[1], sums[2] / sums[0]


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, target: Tensor, vocab_start: int, group: Any, compiled: bool
    ) -> tuple[Tensor, Tensor]:
        # logits [N, V_local] (any float dtype), target [N] global ids
        idx, inside = _target_index(target, vocab_start, logits.shape[-1])
        m, log_s, tgt, mean_shifted = _softmax_stats(logits, idx, inside, group, compiled)
        ctx.save_for_backward(logits, m, log_s, mean_shifted, idx, inside)
        ctx.compiled = compiled
        return tgt - log_s, log_s - mean_shifted

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor, g_ent: Tensor) -> tuple[Tensor | None, ...]:
        grad = _kernel("_logits_grad", ctx.compiled)(*ctx.saved_tensors, g_lp, g_ent)
        return grad, None, None, None, None


def vocab_parallel_logprobs(
    logits: Tensor,
    target: Tensor,
    true_vocab_size: int,
    tp_rank: int = 0,
    tp_group: Any = None,
    compiled: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(logprob of target, entropy)`` in fp32 with the shape of ``target``;
    ``logits`` is ``[..., V_local]``.

    Computation is in fp32 whatever the logits' dtype (``compiled``: fused by torch.compile).
    """
    v_local = logits.shape[-1]
    vocab_start = tp_rank * v_local
    valid = max(0, min(v_local, true_vocab_size - vocab_start))
    if valid == 0:
        raise ValueError(
            f"TP rank {tp_rank} holds only vocabulary padding; lower make_vocab_size_divisible_by"
        )
    lg = logits[..., :valid].reshape(-1, valid)
    lp, ent = _VocabParallelLogprobs.apply(lg, target.reshape(-1), vocab_start, tp_group, compiled)
    return lp.reshape(target.shape), ent.reshape(target.shape)


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """(logprob, entropy) of ``target`` under ``hidden @ weight[:valid].T``, ``chunk`` rows at a time."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        target: Tensor,
        vocab_start: int,
        valid: int,
        group: Any,
        chunk: int,
        compiled: bool,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        stats = torch.empty(3, n, dtype=torch.float32, device=hidden.device)  # m, log Σexp, E_p[shifted]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        idx, inside = _target_index(target, vocab_start, valid)
        w = weight[:valid]
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            m, log_s, tgt, mean_shifted = _softmax_stats(
                hidden[a:b] @ w.T, idx[a:b], inside[a:b], group, compiled
            )
            stats[0, a:b], stats[1, a:b], stats[2, a:b] = m, log_s, mean_shifted
            lp[a:b] = tgt - log_s
        ctx.save_for_backward(hidden, weight, idx, inside, stats)
        ctx.valid, ctx.chunk, ctx.compiled = valid, chunk, compiled
        return lp, stats[1] - stats[2]

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor, g_ent: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, idx, inside, stats = ctx.saved_tensors
        n, w = hidden.shape[0], weight[: ctx.valid]
        logits_grad = _kernel("_logits_grad", ctx.compiled)
        grad_hidden = torch.empty_like(hidden)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for a in range(0, n, ctx.chunk):
            b = min(n, a + ctx.chunk)
            r = slice(a, b)
            grad = logits_grad(
                hidden[r] @ w.T, stats[0, r], stats[1, r], stats[2, r], idx[r], inside[r], g_lp[r], g_ent[r]
            ).to(hidden.dtype)
            grad_hidden[r] = grad @ w
            grad_w += (grad.T @ hidden[r]).float()
        grad_weight = torch.zeros_like(weight)
        grad_weight[: ctx.valid] = grad_w.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


class _ForwardOverride:
    """While :meth:`active`, ``module``'s forward is this object's ``forward`` (then the class's again)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    @contextlib.contextmanager
    def active(self) -> Iterator[Any]:
        self.module.forward = self.forward  # type: ignore[attr-defined]
        try:
            yield self
        finally:
            del self.module.forward  # back to the class's forward


class _HiddenStates(_ForwardOverride):
    """The GPT model's output layer hands back its input (the final hidden states) and records the weight
    it would have used (the shared embedding when tied)."""

    weight: Tensor | None = None

    def forward(self, hidden: Tensor, weight: Tensor | None = None, **_: Any) -> tuple[Tensor, None]:
        self.weight = self.module.weight if weight is None else weight
        return hidden, None


class _TokenRope(_ForwardOverride):
    """The model's rotary embedding returns one row of angles per packed token (its position within its
    own sequence, all below ``max_len``) instead of rows ``0..n-1``."""

    def __init__(self, rope: torch.nn.Module, positions: Tensor, max_len: int) -> None:
        super().__init__(rope)
        self.positions, self.max_len = positions, max_len

    def forward(self, max_seq_len: int, *args: Any, **kwargs: Any) -> Tensor:
        table = type(self.module).forward(self.module, self.max_len, *args, **kwargs)  # [max_len, 1, 1, d]
        return table[self.positions]


def _gpt(model: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module  # DDP / Float16Module wrappers
    return model


class ModelLogprobs:
    """Per-token ``(logprob, entropy)`` of a GPT model on right-padded ``tokens`` / ``targets``, with
    the vocabulary split over this rank's tensor-parallel group; with ``chunk_tokens`` the LM head runs
    in chunks of that many tokens inside the loss (see the module docstring)."""

    def __init__(
        self,
        vocab_size: int,
        tp_rank: int = 0,
        tp_group: Any = None,
        chunk_tokens: int | None = None,
        compiled: bool = False,
    ) -> None:
        self.vocab_size = vocab_size
        self.tp_rank = tp_rank
        self.tp_group = tp_group
        self.chunk_tokens = chunk_tokens
        self.compiled = compiled

    def from_logits(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        return vocab_parallel_logprobs(
            logits, targets, self.vocab_size, self.tp_rank, self.tp_group, self.compiled
        )

    def __call__(self, model: torch.nn.Module, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """One forward of ``model`` (positions ``0..s-1`` on every row, no attention mask: causal)."""
        return self._forward(model, tokens, targets, position_ids(tokens))

    def of(self, model: torch.nn.Module, mb: Any) -> tuple[Tensor, Tensor]:
        """``(logprob, entropy)`` of a :class:`~agentrl.trainer.batch.MicroBatch` in its padded ``[b, s]``
        layout; a packed micro-batch runs packed (attention within each sequence) and is unpacked."""
        pk = mb.packed
        routed = getattr(mb, "routed_experts", None)
        if routed is not None:  # MoE routing replay: the routers take the recorded experts
            from agentrl.trainer.moe import replay_routing

            with replay_routing(_gpt(model), routed, None if pk is None else pk.index):
                return self._of(model, mb)
        return self._of(model, mb)

    def _of(self, model: torch.nn.Module, mb: Any) -> tuple[Tensor, Tensor]:
        pk = mb.packed
        if pk is None:
            pad = getattr(mb, "padding_mask", None)
            if pad is not None:  # MoE: padding stays out of the load-balancing loss
                return self._forward(model, mb.tokens, mb.targets, position_ids(mb.tokens), padding_mask=pad)
            return self(model, mb.tokens, mb.targets)
        from megatron.core.packed_seq_params import PackedSeqParams

        # "sbhd": megatron applies RoPE as for one sequence, with the per-token angles of _TokenRope, in
        # one op per layer (its "thd" path splits every layer's q/k per sequence, with a host sync); the
        # core attention reads the sequence bounds
        params = PackedSeqParams(
            qkv_format="sbhd",
            cu_seqlens_q=pk.cu_seqlens,
            cu_seqlens_kv=pk.cu_seqlens,
            max_seqlen_q=pk.max_seqlen,
            max_seqlen_kv=pk.max_seqlen,
        )
        with _TokenRope(_gpt(model).rotary_pos_emb, pk.positions.reshape(-1), pk.max_seqlen).active():
            lp, ent = self._forward(model, pk.tokens, pk.targets, pk.positions, params)
        shape = tuple(mb.tokens.shape)
        return pk.unpack(lp.reshape(-1), shape), pk.unpack(ent.reshape(-1), shape)

    def _forward(
        self,
        model: torch.nn.Module,
        tokens: Tensor,
        targets: Tensor,
        positions: Tensor,
        packed: Any = None,
        padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        extra: dict[str, Any] = {} if packed is None else {"packed_seq_params": packed}
        if padding_mask is not None:
            extra["padding_mask"] = padding_mask
        if not self.chunk_tokens:
            return self.from_logits(model(tokens, positions, None, **extra), targets)
        with _HiddenStates(_gpt(model).output_layer).active() as head:
            hidden = model(tokens, positions, None, **extra)  # [b, s, h]
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            hidden = copy_to_tensor_model_parallel_region(hidden)  # what the column-parallel head does
        v_local = head.weight.shape[0]
        vocab_start = self.tp_rank * v_local
        valid = max(0, min(v_local, self.vocab_size - vocab_start))
        lp, ent = _ChunkedHeadLogprobs.apply(
            hidden.reshape(-1, hidden.shape[-1]),
            head.weight,
            targets.reshape(-1),
            vocab_start,
            valid,
            self.tp_group,
            self.chunk_tokens,
            self.compiled,
        )
        return lp.reshape(targets.shape), ent.reshape(targets.shape)


def position_ids(tokens: Tensor) -> Tensor:
    """``[b, s]`` positions ``0..s-1`` on every row of right-padded ``tokens``."""
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
