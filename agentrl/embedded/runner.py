"""The embedded engine's model runner: a decoder forward over a slot KV cache, with CUDA graphs for decode.

Every sequence in the engine owns one **slot** of a static KV cache, ``[layers, slots, kv_heads,
context_len + 1, head_dim]`` for keys and for values. The engine keeps its running sequences in slots
``0 .. n-1`` (it compacts on removal), so a decode step over ``n`` sequences reads one contiguous slice
``[:B, :, :L]`` with ``B >= n`` and ``L`` the longest sequence, each rounded up to a bucket; on a GPU
each ``(B, L)`` bucket is one captured CUDA graph, replayed with no per-layer Python. Slots past
``max_batch`` hold finished sequences for prefix reuse (:mod:`agentrl.embedded.prefix_cache`). The last
column of every slot is scratch: padded prefill tokens and padded decode rows write there, and no
attention ever reads it.

The forward runs the decoder layer of :mod:`agentrl.models.decoder` over the HF model's own parameters
(embedding, norms, q/k/v/o projections, MLP, LM head) for the Llama, Qwen2 and Qwen3 families and the
Qwen3-MoE mixture-of-experts family (the experts each token was routed to are kept per slot position
beside the KV cache, for routing replay), so the weights the trainer pushes are the weights served, with
no copy; in batch-invariant mode over the ops of :mod:`agentrl.batch_invariant`, as the trainer's true
on-policy forward runs it. Prefill ("extend") handles a batch of sequences that each already have
``start`` tokens cached and add ``n`` new ones (a fresh prompt, a prompt whose prefix was found in the
cache, or one chunk of a long prompt) with torch SDPA; decode computes attention for one new token per
sequence as two batched matmuls over the cached keys and values.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentrl import batch_invariant as bi
from agentrl.embedded import fp8
from agentrl.embedded.buckets import (
    VERIFY_GRAPH_TOKENS,
    batch_buckets,
    bucket_of,
    length_buckets,
    prefill_buckets,
)
from agentrl.embedded.modes import RunnerModes, resolve_modes
from agentrl.embedded.slot_copy import copy_slots
from agentrl.models.decoder import (
    DecoderOps,
    LayerWeights,
    lm_head,
    post_attention,
    pre_attention,
)
from agentrl.models.moe import MoESpec, refuse_unsupported_moe

log = logging.getLogger("agentrl.engine")

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def decode_attention(
    q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, masked: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per row against its cached keys: q [b, heads, d], kk/vv [b, kv, length, d], ``masked``
    [b, 1, 1, length] True past the row's position. Two batched matmuls (GQA by grouping the query heads)."""
    b, heads, d = q.shape
    kv = kk.shape[1]
    qg = q.view(b, kv, heads // kv, d)
    s = torch.matmul(qg, kk.transpose(-1, -2)).float() * scale  # [b, kv, group, length]
    p = torch.softmax(s.masked_fill(masked, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(p, vv).reshape(b, heads * d)


def refuse_unservable(cfg) -> None:
    """Raise ValueError for a model the runner cannot serve: another family, sliding-window attention, an
    MLP other than SwiGLU, or a mixture-of-experts layout it does not know."""
    refuse_unsupported_moe(cfg.model_type, cfg.to_dict())
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"the embedded engine serves {', '.join(SUPPORTED_MODEL_TYPES)} models, not "
            f"{cfg.model_type!r}; serve it with SGLang (engine.backend: sglang)"
        )
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("the embedded engine has no sliding-window attention; serve this model with SGLang")
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"the embedded engine's MLP is SwiGLU; {cfg.hidden_act!r} is not served")


@dataclass
class ExtendBatch:
    """A prefill step: row ``r`` adds ``tokens[r]`` at positions ``start[r]..`` of slot ``slots[r]``."""

    slots: list[int]
    tokens: list[list[int]]  # the new tokens of each row
    start: list[int]  # tokens already in the slot's cache


class ModelRunner:
    """Forward passes of one HF causal LM over a slot KV cache (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int,
        context_len: int,
        max_batch: int,
        cuda_graphs: bool = True,
        compile: bool = False,
        batch_invariant: bool = False,
        kv_region: Callable[[], AbstractContextManager] | None = None,
        quantization: str | None = None,
        weights_region: Callable[[], AbstractContextManager] | None = None,
        verify_tokens: int = 0,
    ) -> None:
        cfg = model.config
        refuse_unservable(cfg)
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        attn = self.layers[0].self_attn
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(attn, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.scale = float(getattr(attn, "scaling", self.head_dim**-0.5))
        self.moe = MoESpec.from_hf_config(cfg.to_dict())
        self.weights = [LayerWeights.of_hf_layer(layer, self.moe) for layer in self.layers]
        self.device = next(model.parameters()).device
        if quantization is not None:  # weights_region: where the fp8 copies live (released with the weights)
            with weights_region() if weights_region is not None else contextlib.nullcontext():
                self.weights = fp8.quantized_layers(quantization, self.weights, batch_invariant, self.device)
        self.served = self.weights  # what the forward runs: these, or LoRA records over them (.serve)
        self.norm_eps = float(self.layers[0].input_layernorm.variance_epsilon)
        self.final_norm = self.inner.norm.weight
        self.lm_head_weight = model.get_output_embeddings().weight
        self.vocab_size = int(self.lm_head_weight.shape[0])
        self.dtype = next(model.parameters()).dtype
        self.context_len = context_len
        self.max_batch = max_batch
        self.num_slots = num_slots
        modes = resolve_modes(
            self.device,
            self.head_dim,
            self.moe,
            getattr(self.inner.rotary_emb, "rope_type", "default"),
            cuda_graphs=cuda_graphs,
            compile=compile,
            batch_invariant=batch_invariant,
            quantization=quantization,
        )
        # the runner's state starts from its modes; its ops change with unmerged LoRA (.serve)
        self.batch_invariant, self.quantization = modes.batch_invariant, modes.quantization
        self.cuda_graphs, self.compiled, self.ops = modes.cuda_graphs, modes.compiled, modes.ops
        self.packed_prefill, self.decode_attention = modes.packed_prefill, modes.decode_attention

        self.k, self.v, self.routed = self._slot_cache(kv_region)
        self.cos, self.sin = self._rope_tables()  # [context_len + 1, head_dim]
        self._route_at: tuple = ()  # (slot index, position index) of the tokens in the running forward

        self.batch_buckets = batch_buckets(max_batch)
        self.length_buckets = length_buckets(context_len)
        self._ids = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self._pos = torch.full((max_batch,), context_len, dtype=torch.long, device=self.device)
        self._rows = torch.arange(max_batch, device=self.device)
        self._logits = torch.zeros(max_batch, self.vocab_size, dtype=torch.float32, device=self.device)
        self._pre, self._post, self._attn, self._head = self._layer_pieces(modes)
        self._pinned = (
            torch.empty(2 * max_batch, dtype=torch.long).pin_memory() if self.device.type == "cuda" else None
        )
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        # packed prefill graphs, one per token bucket (powers of two up to PREFILL_GRAPH_TOKENS), reading
        # one static buffer laid out per bucket as _extend_forward reads it
        self.prefill_buckets: list[int] = []
        self._prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if modes.prefill_graphs:
            self.prefill_buckets = prefill_buckets()
            top = self.prefill_buckets[-1]
            size = 3 * top + max_batch + 4 * self._prefill_blocks(top)
            self._p_flat = torch.zeros(size, dtype=torch.long, device=self.device)
        # verify graphs (speculative decoding, ``verify_tokens``: the largest verify step), one per token
        # bucket up to VERIFY_GRAPH_TOKENS, reading the prefill graphs' buffer and writing every token's
        # logits into their own
        self.verify_buckets: list[int] = []
        self._verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if modes.prefill_graphs and verify_tokens > 0:
            cap = min(verify_tokens, VERIFY_GRAPH_TOKENS)
            self.verify_buckets = [b for b in self.prefill_buckets if b < cap]
            self.verify_buckets.append(next(b for b in self.prefill_buckets if b >= cap))
            top = self.verify_buckets[-1]
            self._v_logits = torch.zeros(top, self.vocab_size, dtype=torch.float32, device=self.device)
            size = 4 * top + 4 * self._prefill_blocks(top)
            if size > self._p_flat.numel():
                self._p_flat = torch.zeros(size, dtype=torch.long, device=self.device)

    def _slot_cache(
        self, kv_region: Callable[[], AbstractContextManager] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The KV cache, keys and values ``[layers, slots, kv_heads, context_len + 1, head_dim]``, and for a
        mixture-of-experts model the experts of every (layer, slot, position), written where the KV goes
        (-1: not computed; part of the KV cache, released and resumed with it). Allocated in ``kv_region``
        (a releasable memory region: agentrl.embedded.memory) where given."""
        region = kv_region if kv_region is not None else contextlib.nullcontext
        shape = (len(self.layers), self.num_slots, self.n_kv, self.context_len + 1, self.head_dim)
        routed = None
        with region():
            # Zeros, not empty: masked keys still enter SDPA's sums, and garbage bits could be NaN.
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.moe is not None:
                experts = (len(self.layers), self.num_slots, self.context_len + 1, self.moe.topk)
                routed = torch.full(experts, -1, dtype=torch.int32, device=self.device)
        return k, v, routed

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [context_len + 1, head_dim]: the model's own RoPE (scaling variants included); in
        batch-invariant mode by element-wise products, as the trainer's true on-policy forward builds them."""
        if self.batch_invariant:
            return bi.rope_tables(
                self.inner.rotary_emb.inv_freq, self.context_len + 1, self.device, self.dtype
            )
        pos = torch.arange(self.context_len + 1, device=self.device)[None]
        dummy = torch.zeros(1, dtype=torch.float32, device=self.device)
        cos, sin = self.inner.rotary_emb(dummy, pos)
        return cos[0].to(self.dtype), sin[0].to(self.dtype)

    @staticmethod
    def _layer_pieces(modes: RunnerModes) -> tuple[Callable, Callable, Callable, Callable]:
        """The layer's pieces (agentrl.models.decoder), compiled where the modes say. They are functions of
        tensors (not modules), so one compilation serves every layer."""
        pre, post, attn, head = pre_attention, post_attention, decode_attention, lm_head
        if modes.compiled:
            pre, attn, head = (torch.compile(f, dynamic=True) for f in (pre, attn, head))
        if modes.compiled_mlp:
            post = torch.compile(post, dynamic=True)
        return pre, post, attn, head

    @staticmethod
    def kv_bytes_per_token(model: torch.nn.Module) -> int:
        """KV cache bytes one token takes in one slot (keys and values, all layers)."""
        cfg = model.config
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        elem = next(model.parameters()).element_size()
        return 2 * int(cfg.num_hidden_layers) * kv * head_dim * elem

    # ------------------------------------------------------------------ cache slots
    def copy_slots(self, copies: list[tuple[int, int, int, int]]) -> None:
        """Apply ``copies`` in order: ``(src, dst, n, start)`` copies cached positions ``start..n-1`` of slot
        ``src`` into slot ``dst`` (all layers); on a GPU one launch per wave of independent copies
        (:mod:`agentrl.embedded.slot_copy`)."""
        copy_slots(self.k, self.v, copies)
        if self.routed is not None:
            for src, dst, n, start in copies:
                if n > start and src != dst:
                    self.routed[:, dst, start:n].copy_(self.routed[:, src, start:n])

    def routed_experts(self, slot: int, n: int) -> torch.Tensor:
        """MoE models: the experts positions ``0..n-1`` of ``slot`` were routed to, int32 [n, layers, k]
        on the CPU (SGLang's routed_experts layout)."""
        if self.routed is None:
            raise ValueError("routed_experts: the served model is not a mixture-of-experts model")
        return self.routed[:, slot, :n].permute(1, 0, 2).to("cpu", copy=True)

    # ------------------------------------------------------------------ shared pieces
    def _pre_attention(self, x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """A layer's (q, k, v) of the residual stream ``x`` (agentrl.models.decoder)."""
        return self._pre(x, w, cos, sin, self.norm_eps, self.n_heads, self.n_kv, self.head_dim, self.ops)

    def _post_attention(self, i: int, x: torch.Tensor, o: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """Layer ``i``'s residual stream after its attention output ``o`` and its MLP; a mixture-of-experts
        layer's routing is written where the KV goes (``_route_at``)."""
        x, routed = self._post(x, o, w, self.norm_eps, self.ops)
        if routed is not None:
            self.routed[i][self._route_at] = routed  # type: ignore[index]
        return x

    def _logits_of(self, x: torch.Tensor) -> torch.Tensor:
        return self._head(x, self.final_norm, self.norm_eps, self.lm_head_weight, self.ops)

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def extend(self, batch: ExtendBatch, every_token: bool = False) -> torch.Tensor:
        """Run the new tokens of every row through the model, writing their KV into the rows' slots.
        Returns fp32 logits [rows, vocab] at each row's last new token, or with ``every_token`` at every
        new token, the rows' tokens in order [tokens, vocab] (a speculative verify step: .speculative)."""
        if self.packed_prefill:
            return self._extend_packed(batch, every_token)
        dev = self.device
        rows = len(batch.slots)
        width = max(len(t) for t in batch.tokens)
        lens = torch.tensor([len(t) for t in batch.tokens], device=dev)
        start = torch.tensor(batch.start, device=dev)
        slots = torch.tensor(batch.slots, device=dev)
        ids = torch.tensor([t + [0] * (width - len(t)) for t in batch.tokens]).to(dev)
        offs = torch.arange(width, device=dev)
        pos = start[:, None] + offs[None]  # [rows, width]
        valid = offs[None] < lens[:, None]
        write = torch.where(valid, pos, self.context_len)  # padding writes to the scratch column
        # Fresh rows (nothing cached) attend only to their own new tokens, and right padding sits after
        # every real token: plain causal attention over this step's k/v, no mask (the flash kernel).
        fresh = not any(batch.start)
        keys = max(s + len(t) for s, t in zip(batch.start, batch.tokens, strict=True))
        mask = None
        if not fresh:
            kpos = torch.arange(keys, device=dev)
            mask = (kpos[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [rows, 1, width, keys]
        cos, sin = self.cos[pos.clamp(max=self.context_len)], self.sin[pos.clamp(max=self.context_len)]
        group = self.n_heads // self.n_kv
        self._route_at = (slots[:, None], write)  # MoE routing goes where the KV goes

        x = self.inner.embed_tokens(ids)
        qpos = torch.where(valid, pos, 0)  # padding queries attend to key 0 only (their output is dropped)
        for i, w in enumerate(self.served):
            q, k, v = self._pre_attention(x, w, cos, sin)
            self.k[i][slots[:, None], :, write] = k
            self.v[i][slots[:, None], :, write] = v
            if self.batch_invariant:  # from the cache, as decode reads it (the kernel reads the keys in use)
                o = bi.attention(q, self.k[i], self.v[i], qpos, self.scale, slots)
                x = self._post_attention(i, x, o, w)
                continue
            if fresh:
                kk, vv = k.transpose(1, 2), v.transpose(1, 2)
            else:
                kk = self.k[i][:, :, :keys].index_select(0, slots)  # slice first: copy only the keys in use
                vv = self.v[i][:, :, :keys].index_select(0, slots)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                kk,
                vv,
                attn_mask=mask,
                is_causal=fresh,
                scale=self.scale,
                enable_gqa=group > 1,
            )
            x = self._post_attention(i, x, o.transpose(1, 2).reshape(rows, width, -1), w)
        if every_token:
            return self._logits_of(x[valid])
        last = x[torch.arange(rows, device=dev), lens - 1]
        return self._logits_of(last)

    def _extend_packed(self, batch: ExtendBatch, every_token: bool = False) -> torch.Tensor:
        """:meth:`extend` over the rows' tokens laid end to end: every op runs on real tokens only, and
        attention reads each row's keys from its slot (see :mod:`agentrl.embedded.attention`). A step of up
        to :data:`~agentrl.embedded.buckets.PREFILL_GRAPH_TOKENS` tokens (with ``every_token``, a
        speculative verify step: up to the largest of :attr:`verify_buckets`) replays the CUDA graph of its
        token bucket (a step of a few short turns is otherwise ~20 ms of kernel launches for ~3 ms of GPU
        work); larger steps run eagerly."""
        t = sum(len(toks) for toks in batch.tokens)
        buckets, graphs = (
            (self.verify_buckets, self._verify_graphs)
            if every_token
            else (self.prefill_buckets, self._prefill_graphs)
        )
        rows = t if every_token else len(batch.slots)  # logits returned: every token's, or each row's last
        bucket = next((b for b in buckets if b >= t), None)  # none without graphs
        if bucket is None:  # eager, exact sizes
            flat, blocks = self._packed_layout(batch, every_token=every_token)
            if self.device.type == "cuda":
                flat = flat.pin_memory().to(self.device, non_blocking=True)
            return self._extend_forward(flat, t, rows, blocks)
        graph = graphs.get(bucket)
        if graph is None:  # before the copy: the capture runs on padding in the same buffer
            graph = self._capture_packed(bucket, every_token)
        nb = self._prefill_blocks(bucket)
        host, _ = self._packed_layout(batch, bucket, self._graph_rows(bucket, every_token), nb, every_token)
        self._p_flat[: host.numel()].copy_(host.pin_memory(), non_blocking=True)
        graph.replay()
        return (self._v_logits if every_token else self._logits)[:rows]

    def _graph_rows(self, bucket: int, every_token: bool) -> int:
        """Logit rows the graph of a packed step of ``bucket`` tokens computes: every token's (a verify
        step), or the last token's of up to ``max_batch`` rows."""
        return bucket if every_token else self.max_batch

    def _packed_layout(
        self, batch: ExtendBatch, tokens: int = 0, rows: int = 0, blocks: int = 0, every_token: bool = False
    ) -> tuple[torch.Tensor, int]:
        """The host buffer :meth:`_extend_forward` reads, and its number of kernel blocks:
        ``[ids | slots | positions]`` of the step's tokens, each row's last token in the packing (with
        ``every_token`` every token), the kernel's ``[4, blocks]`` table. Padded to at least ``tokens``
        tokens (ids 0 at the scratch column of slot 0), ``rows`` last-token entries (0) and ``blocks``
        blocks (empty), as a graph's bucket lays them out; by default exact."""
        from agentrl.embedded.attention import block_table

        lens = [len(toks) for toks in batch.tokens]
        ids, slot_t, pos_t = [], [], []
        for slot, toks, s in zip(batch.slots, batch.tokens, batch.start, strict=True):
            ids.extend(toks)
            slot_t.extend([slot] * len(toks))
            pos_t.extend(range(s, s + len(toks)))
        last = list(itertools.accumulate(lens, initial=-1))[1:]  # each row's last token in the packing
        if every_token:
            last = list(range(len(ids)))
        table = block_table(batch.slots, lens, batch.start)
        pad = max(tokens - len(ids), 0)
        fill = max(blocks - len(table[0]), 0)
        host = torch.tensor(
            [
                *ids,
                *[0] * pad,
                *slot_t,
                *[0] * pad,
                *pos_t,
                *[self.context_len] * pad,
                *last,
                *[0] * max(rows - len(last), 0),
                *itertools.chain(*(b + [0] * fill for b in table)),
            ],
            dtype=torch.long,
        )
        return host, len(table[0]) + fill

    def _prefill_blocks(self, tokens: int) -> int:
        """Kernel blocks a packed step of ``tokens`` tokens may need: one per full block of tokens and
        one partial block per row."""
        from agentrl.embedded.attention import BLOCK_M

        return tokens // BLOCK_M + min(self.max_batch, tokens)

    def _extend_forward(self, flat: torch.Tensor, t: int, rows: int, nb: int) -> torch.Tensor:
        """The packed prefill forward from one flat buffer laid out as ``[ids | slots | positions]`` of
        ``t`` tokens, ``rows`` last-token indices and the kernel's ``[4, nb]`` blocks. Returns fp32 logits
        [rows, vocab]. Graph-capturable: no host syncs."""
        from agentrl.embedded.attention import extend_attention

        ids_d, slot_d, pos_d = flat[:t], flat[t : 2 * t], flat[2 * t : 3 * t]
        last_d, meta = flat[3 * t : 3 * t + rows], flat[3 * t + rows : 3 * t + rows + 4 * nb].view(4, nb)
        cos, sin = self.cos[pos_d], self.sin[pos_d]
        self._route_at = (slot_d, pos_d)  # MoE routing goes where the KV goes
        x = self.inner.embed_tokens(ids_d)  # [tokens, hidden]
        for i, w in enumerate(self.served):
            q, k, v = self._pre_attention(x, w, cos, sin)
            self.k[i][slot_d, :, pos_d] = k
            self.v[i][slot_d, :, pos_d] = v
            o = extend_attention(q, self.k[i], self.v[i], meta, self.scale)
            x = self._post_attention(i, x, o, w)
        return self._logits_of(x.index_select(0, last_d))

    def _capture_packed(self, bucket: int, every_token: bool) -> torch.cuda.CUDAGraph:
        """Capture the packed step of ``bucket`` tokens: a prefill (all rows' last tokens, up to
        max_batch) or with ``every_token`` a verify step (every token, padding included), with the bucket's
        blocks. The warm-up runs are all padding: they write only the scratch column."""
        t, rows, nb = bucket, self._graph_rows(bucket, every_token), self._prefill_blocks(bucket)
        out = self._v_logits[:t] if every_token else self._logits
        flat = self._p_flat
        flat[: 3 * t + rows + 4 * nb].zero_()
        flat[2 * t : 3 * t].fill_(self.context_len)
        graph = self._graph_of(lambda: out.copy_(self._extend_forward(flat, t, rows, nb)))
        (self._verify_graphs if every_token else self._prefill_graphs)[bucket] = graph
        return graph

    # ------------------------------------------------------------------ decode
    def _decode_forward(self, b: int, length: int) -> torch.Tensor:
        """One token for rows (= slots) ``0..b-1`` from the static id/position buffers; attends to ``length``
        cached positions. Graph-capturable: no host syncs, fixed shapes."""
        ids, pos, rows = self._ids[:b], self._pos[:b], self._rows[:b]
        cos, sin = self.cos[pos], self.sin[pos]
        group = self.n_heads // self.n_kv
        masked = torch.arange(length, device=self.device)[None, None, None, :] > pos[:, None, None, None]
        # masked: [b, 1, 1, length], True where a key is past the row's position
        apos = pos.masked_fill(pos >= self.context_len, 0)  # padding rows (scratch column) read key 0 only
        self._route_at = (rows, pos)  # MoE routing goes where the KV goes
        x = self.inner.embed_tokens(ids)
        for i, w in enumerate(self.served):
            q, k, v = self._pre_attention(x, w, cos, sin)
            self.k[i][rows, :, pos] = k  # KV writes stay outside compiled code: no copy of the cache
            self.v[i][rows, :, pos] = v
            kk, vv = self.k[i][:b, :, :length], self.v[i][:b, :, :length]  # [b, kv, length, d]
            if self.batch_invariant:
                if not q.is_cuda:  # the CPU kernel reads the key chunks up to the last position only
                    kk, vv = self.k[i][:b], self.v[i][:b]
                o = bi.attention(q[:, None], kk, vv, apos[:, None], self.scale).view(b, -1)
            elif self.decode_attention == "sdpa":
                o = F.scaled_dot_product_attention(
                    q[:, :, None], kk, vv, attn_mask=~masked, scale=self.scale, enable_gqa=group > 1
                ).reshape(b, -1)
            else:
                o = self._attn(q, kk, vv, masked, self.scale)
            x = self._post_attention(i, x, o, w)
        return self._logits_of(x)

    @torch.inference_mode()
    def decode(self, ids: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step for the sequences in slots ``0..len(ids)-1``: ``ids[r]`` is the token at
        ``positions[r]`` (its KV is written there). Returns fp32 logits [rows, vocab] (a view, valid until
        the next call)."""
        n = len(ids)
        b = bucket_of(n, self.batch_buckets) if self.cuda_graphs else n
        length = bucket_of(max(positions) + 1, self.length_buckets)
        host = torch.tensor(ids + [0] * (b - n) + positions + [self.context_len] * (b - n), dtype=torch.long)
        if self._pinned is not None:  # the previous step's copy is done: its tokens were read back since
            self._pinned[: 2 * b].copy_(host)
            host = self._pinned[: 2 * b]
        both = host.to(self.device, non_blocking=True)
        self._ids[:b].copy_(both[:b])
        self._pos[:b].copy_(both[b:])
        if not self.cuda_graphs:
            return self._decode_forward(b, length)
        graph = self._graphs.get((b, length))
        if graph is None:
            graph = self._capture(b, length)
        graph.replay()
        return self._logits[:n]

    def _capture(self, b: int, length: int) -> torch.cuda.CUDAGraph:
        """Capture the decode graph of bucket (b, length). The warm-up runs write only to the scratch
        column (positions set to it), so capturing while sequences are cached is safe."""
        saved = self._pos[:b].clone()
        self._pos[:b].fill_(self.context_len)
        graph = self._graph_of(lambda: self._logits[:b].copy_(self._decode_forward(b, length)))
        self._pos[:b].copy_(saved)
        self._graphs[(b, length)] = graph
        return graph

    def _graph_of(self, step: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """``step`` run twice on a side stream (compiles, allocator warm-up), then captured into the
        runner's one graph pool, which every decode and prefill graph shares."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            step()
        if self._pool is None:
            self._pool = graph.pool()
        return graph

    def serve(self, layers: list[LayerWeights], ops: DecoderOps) -> None:
        """Run ``layers`` over ``ops`` from now on (unmerged LoRA's records over :attr:`weights`:
        agentrl.embedded.lora); the graphs captured over the old ones go."""
        self.served, self.ops = layers, ops
        self.drop_graphs()

    def drop_graphs(self) -> None:
        """Forget the captured decode, prefill and verify graphs (their memory moved: see
        :mod:`agentrl.embedded.memory`); each bucket is captured again when next used."""
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._verify_graphs.clear()
        self._pool = None

    def capture_all(self, max_length: int | None = None) -> int:
        """Capture every decode bucket up to ``max_length`` now (start-up), so none is captured mid-run."""
        if not self.cuda_graphs:
            return 0
        for length in self.length_buckets:
            if max_length is not None and length > max(max_length, self.length_buckets[0]):
                break
            for b in self.batch_buckets:
                if (b, length) not in self._graphs:
                    self._capture(b, length)
        for bucket in self.prefill_buckets:
            if bucket not in self._prefill_graphs:
                self._capture_packed(bucket, every_token=False)
        for bucket in self.verify_buckets:
            if bucket not in self._verify_graphs:
                self._capture_packed(bucket, every_token=True)
        return len(self._graphs) + len(self._prefill_graphs) + len(self._verify_graphs)


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ExtendBatch",
    "ModelRunner",
]
