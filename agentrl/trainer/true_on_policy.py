"""Exactly on-policy logprobs (``trainer.true_on_policy``): the trainer's forward in the engine's kernels.

The embedded engine in batch-invariant mode computes a token's logprob with the ops of
:mod:`agentrl.batch_invariant` in one order (embedding, RMSNorm, q/k/v projections, RoPE from
element-wise tables, attention over keys ``0..pos`` in fixed chunks, SwiGLU, LM head, ``logits[target] -
logsumexp``), and those ops give a row the same bits whatever else is in the call. A full-sequence
forward is then the same computation as the engine's prefill, which equals its decode; so
:class:`TrueOnPolicyLogprobs`, which runs the engine's decoder layer (:mod:`agentrl.models.decoder`) in
those ops over the megatron model's own parameters, gives π_old and the loss's logprobs equal to the
rollout's for the same weights and tokens: mismatch KL 0, every TIS weight 1, PPO-KL 0 on the first
step. Dense models, TP = PP = 1.

Gradients flow to the parameters through the same graph: on a GPU each Triton op has a torch backward,
and with ``deterministic_backward`` (the deterministic mode, whose runs must repeat bit for bit) the
attention's is torch's math kernel, which, unlike the flash backward, sums in one order. The forward
reads megatron's fused projections (``linear_qkv``, ``linear_fc1``) as they are, so backward produces
each one's weight gradient in one product.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from agentrl import batch_invariant as bi
from agentrl.models.decoder import BATCH_INVARIANT_OPS, LayerWeights, lm_head, post_attention, pre_attention
from agentrl.trainer.arch import ModelArch
from agentrl.trainer.logprobs import _kernel, _softmax_stats

Tensor = torch.Tensor


def rope_inv_freq(theta: float, head_dim: int) -> Tensor:
    """Plain RoPE's inverse frequencies as Hugging Face's Llama/Qwen modules compute them (fp32, CPU)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _gpt(model: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module  # DDP / Float16Module wrappers
    return model


class _HeadLogprobs(torch.autograd.Function):
    """(logprob of the target, entropy) of rows of final hidden states. The logprob is the engine's
    (:func:`agentrl.models.decoder.lm_head` in batch-invariant ops, then ``token_logprobs``); the entropy
    and the gradient come from the default path's fused softmax statistics (:mod:`agentrl.trainer.logprobs`,
    compiled on a GPU), which no bit has to match. Nothing of [rows, vocabulary] is kept for backward: it
    recomputes the logits."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, norm: Tensor, head: Tensor, targets: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        logits = lm_head(hidden, norm, eps, head, BATCH_INVARIANT_OPS)
        lp = bi.token_logprobs(logits, targets)
        inside = torch.ones_like(targets, dtype=torch.bool)
        m, log_s, _, mean_shifted = _softmax_stats(logits, targets, inside, None, logits.is_cuda)
        ctx.save_for_backward(hidden, norm, head, targets, m, log_s, mean_shifted)
        ctx.eps = eps
        return lp, log_s - mean_shifted

    @staticmethod
    def backward(ctx, g_lp: Tensor, g_ent: Tensor):  # type: ignore[override]
        hidden, norm, head, targets, m, log_s, mean_shifted = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [
                t.detach().requires_grad_(need)
                for t, need in zip((hidden, norm, head), ctx.needs_input_grad[:3], strict=True)
            ]
            logits = lm_head(leaves[0], leaves[1], ctx.eps, leaves[2], BATCH_INVARIANT_OPS)
        inside = torch.ones_like(targets, dtype=torch.bool)
        grad = _kernel("_logits_grad", logits.is_cuda)(
            logits.detach(), m, log_s, mean_shifted, targets, inside, g_lp.float(), g_ent.float()
        )
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(logits, wanted, grad) if wanted else ())
        return (*(next(got) if t.requires_grad else None for t in leaves), None, None)


def _head_logprobs(
    hidden: Tensor, targets: Tensor, norm: Tensor, head: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """(logprob of the target, entropy) of rows of final hidden states, as the engine computes the logprob."""
    return _HeadLogprobs.apply(hidden, norm, head, targets, eps)


class TrueOnPolicyLogprobs:
    """``(logprob, entropy)`` per token of a megatron GPT model, the logprob computed as the batch-invariant
    embedded engine computes it; a drop-in for :class:`~agentrl.trainer.logprobs.ModelLogprobs` (``of``).
    Without autograd only the logprob is computed (the entropy is None)."""

    HEAD_CHUNK = 4096  # token rows per LM-head chunk

    def __init__(
        self, arch: ModelArch, tp: int = 1, pp: int = 1, deterministic_backward: bool = False
    ) -> None:
        if tp != 1 or pp != 1:
            raise ValueError("trainer.true_on_policy: needs tp = 1 and pp = 1")
        self.arch = arch
        self.deterministic_backward = deterministic_backward  # the attention backward by torch's math kernel
        self.inv_freq = rope_inv_freq(arch.rope_theta, arch.head_dim)
        self.scale = arch.head_dim**-0.5  # the HF attention's own scaling
        self._tables: dict[tuple[str, torch.dtype], tuple[Tensor, Tensor]] = {}

    def _rope(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin [n', head_dim] of positions ``0..n'-1``, n' >= n."""
        key = (str(device), dtype)
        have = self._tables.get(key)
        if have is None or have[0].shape[0] < n:  # element-wise tables: a longer one agrees on its prefix
            have = bi.rope_tables(self.inv_freq, max(n, 2048), device, dtype)
            self._tables[key] = have
        return have

    def _layer_weights(self, layer: torch.nn.Module) -> LayerWeights:
        """One megatron layer's tensors, its fused projections as they are: ``linear_qkv`` (per KV group:
        its query heads, its key head, its value head) and ``linear_fc1`` ([gate; up])."""
        a, m, arch = layer.self_attention, layer.mlp, self.arch
        return LayerWeights(
            input_norm=layer.input_layernorm.weight,
            qkv=a.linear_qkv.weight,
            qkv_bias=a.linear_qkv.bias if arch.qkv_bias else None,
            q_norm=a.q_layernorm.weight if arch.qk_norm else None,
            k_norm=a.k_layernorm.weight if arch.qk_norm else None,
            o=a.linear_proj.weight,
            mlp_norm=layer.pre_mlp_layernorm.weight,
            gate_up=m.linear_fc1.weight,
            down=m.linear_fc2.weight,
        )

    def __call__(
        self, model: torch.nn.Module, tokens: Tensor, targets: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """``tokens``/``targets`` [b, s], right-padded, positions ``0..s-1`` on every row. Autograd runs
        through this forward; without autograd the entropy is None."""
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device).expand(b, s)
        return self._forward(model, tokens.reshape(-1), targets.reshape(-1), positions.reshape(-1), (b, s))

    def of(self, model: torch.nn.Module, mb: Any) -> tuple[Tensor, Tensor | None]:
        """Of a :class:`~agentrl.trainer.batch.MicroBatch`, in its padded ``[b, s]`` layout. A packed one
        runs packed: the projections, norms and the LM head over its real tokens only, attention per
        sequence (each scattered into its row of the padded layout); the same bits at every real token,
        since every op but attention works row by row, and zeros at padding."""
        pk = mb.packed
        if pk is None:
            return self(model, mb.tokens, mb.targets)
        return self._forward(
            model,
            pk.tokens.reshape(-1),
            pk.targets.reshape(-1),
            pk.positions.reshape(-1),
            tuple(mb.tokens.shape),
            pk,
        )

    def _forward(
        self,
        model: torch.nn.Module,
        tokens: Tensor,
        targets: Tensor,
        positions: Tensor,
        shape: tuple[int, int],
        packed: Any = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``(logprob, entropy)`` [b, s] of token rows ``tokens``/``targets``/``positions`` [n]: the ``b × s``
        grid itself, or with ``packed`` (:class:`~agentrl.trainer.batch.PackedTokens`) its packed tokens."""
        gpt, arch = _gpt(model), self.arch
        if not hasattr(gpt.decoder, "layers") or any(hasattr(la.mlp, "experts") for la in gpt.decoder.layers):
            raise ValueError("trainer.true_on_policy: dense models only")
        b, s = shape
        x = F.embedding(tokens, gpt.embedding.word_embeddings.weight)  # [n, hidden]
        cos, sin = self._rope(s, x.device, x.dtype)
        cos, sin = cos[positions], sin[positions]  # a row per token
        qpos = torch.arange(s, device=x.device).expand(b, s)
        eps, heads, kv, d = arch.rms_norm_eps, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim

        def grid(t: Tensor) -> Tensor:  # token rows -> [b, s, ...] (zeros in the cells no token fills)
            return t.view(b, s, *t.shape[1:]) if packed is None else packed.unpack(t, shape)

        for layer in gpt.decoder.layers:
            w = self._layer_weights(layer)
            q, k, v = pre_attention(x, w, cos, sin, eps, heads, kv, d, BATCH_INVARIANT_OPS)
            o = bi.attention(
                grid(q),
                grid(k).transpose(1, 2),
                grid(v).transpose(1, 2),
                qpos,
                self.scale,
                deterministic_backward=self.deterministic_backward,
            ).view(b * s, -1)
            x, _ = post_attention(
                x, o if packed is None else o.index_select(0, packed.index), w, eps, BATCH_INVARIANT_OPS
            )
        head = (
            gpt.shared_embedding_or_output_weight() if arch.tie_word_embeddings else gpt.output_layer.weight
        )
        norm, head = gpt.decoder.final_layernorm.weight, head[: arch.vocab_size]
        tgt, n = targets.clamp(min=0), x.shape[0]
        # the head runs in chunks of rows (row-invariant ops: the same bits as all at once), each
        # recomputed in backward, so no fp32 [tokens, vocabulary] logits outlive one chunk
        chunks = range(0, n, self.HEAD_CHUNK)
        if not torch.is_grad_enabled():
            lp = torch.cat(
                [
                    bi.token_logprobs(
                        lm_head(x[i : i + self.HEAD_CHUNK], norm, eps, head, BATCH_INVARIANT_OPS),
                        tgt[i : i + self.HEAD_CHUNK],
                    )
                    for i in chunks
                ]
            )
            return grid(lp), None
        outs = [
            _head_logprobs(x[i : i + self.HEAD_CHUNK], tgt[i : i + self.HEAD_CHUNK], norm, head, eps)
            for i in chunks
        ]
        return grid(torch.cat([o[0] for o in outs])), grid(torch.cat([o[1] for o in outs]))


__all__ = ["TrueOnPolicyLogprobs", "rope_inv_freq"]
