"""The decoder layer of :mod:`agentrl.models.decoder` on CPU: the weights record names a whole layer and
refuses half of one; each ops table runs its ops in the order that keeps the engine's and the trainer's
bits (pinned here op by op); fused projections give the separate ones' bits in batch-invariant ops; a
mixture-of-experts layer reports its routing, and batch-invariant ops refuse it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrl import batch_invariant as bi
from agentrl.models.decoder import (
    BATCH_INVARIANT_OPS,
    TORCH_OPS,
    Experts,
    LayerWeights,
    experts_grouped,
    lm_head,
    moe_mlp,
    post_attention,
    pre_attention,
    route,
)

HIDDEN, HEADS, KV, D, FFN = 64, 4, 2, 16, 96


def _rand(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g) / shape[-1] ** 0.5


def _layer(seed: int = 0, bias: bool = True, qk_norm: bool = True) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    t = {
        "input_norm": 1 + _rand(HIDDEN, g=g),
        "q": _rand(HEADS * D, HIDDEN, g=g),
        "k": _rand(KV * D, HIDDEN, g=g),
        "v": _rand(KV * D, HIDDEN, g=g),
        "o": _rand(HIDDEN, HEADS * D, g=g),
        "mlp_norm": 1 + _rand(HIDDEN, g=g),
        "gate": _rand(FFN, HIDDEN, g=g),
        "up": _rand(FFN, HIDDEN, g=g),
        "down": _rand(HIDDEN, FFN, g=g),
    }
    for name, n in (("q_bias", HEADS * D), ("k_bias", KV * D), ("v_bias", KV * D)):
        t[name] = _rand(n, g=g) if bias else None
    t["q_norm"] = 1 + _rand(D, g=g) if qk_norm else None
    t["k_norm"] = 1 + _rand(D, g=g) if qk_norm else None
    return t


def _fused(t: dict) -> LayerWeights:
    """``t`` in megatron-core's layout: per key head its query heads, its key, its value; [gate; up]."""

    def qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rest = q.shape[1:]
        groups = [q.reshape(KV, HEADS // KV * D, *rest), k.reshape(KV, D, *rest), v.reshape(KV, D, *rest)]
        return torch.cat(groups, 1).reshape(-1, *rest)

    bias = None if t["q_bias"] is None else qkv(t["q_bias"], t["k_bias"], t["v_bias"])
    return LayerWeights(
        input_norm=t["input_norm"],
        qkv=qkv(t["q"], t["k"], t["v"]),
        qkv_bias=bias,
        q_norm=t["q_norm"],
        k_norm=t["k_norm"],
        o=t["o"],
        mlp_norm=t["mlp_norm"],
        gate_up=torch.cat([t["gate"], t["up"]]),
        down=t["down"],
    )


def _inputs(rows: int = 20) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, HIDDEN, generator=g)
    o = torch.randn(rows, HEADS * D, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = bi.rope_tables(inv_freq, rows, x.device, x.dtype)
    return x, o, cos, sin


def test_the_record_names_a_whole_layer() -> None:
    t = _layer()
    LayerWeights(**t)  # separate projections
    _fused(t)  # fused ones
    sep = {k: t[k] for k in ("q", "k", "v", "gate", "up", "down")}
    experts = Experts(
        torch.zeros(4, HIDDEN), torch.zeros(4, 2 * FFN, HIDDEN), torch.zeros(4, HIDDEN, FFN), 2, True
    )
    half = [
        {**t, "k": None},  # a projection missing
        {**t, "qkv": torch.cat([sep["q"], sep["k"], sep["v"]])},  # separate and fused at once
        {**t, "up": None},
        {**t, "gate_up": torch.cat([sep["gate"], sep["up"]])},
        {**t, "down": None},
        {**t, "experts": experts},  # experts beside a dense MLP
        {**t, "k_norm": None},
    ]
    for fields in half:
        with pytest.raises(ValueError, match="LayerWeights"):
            LayerWeights(**fields)
    LayerWeights(**{**t, "gate": None, "up": None, "down": None, "experts": experts})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_run_the_engines_default_order(dtype: torch.dtype) -> None:
    """Plain torch: each projection one F.linear with its bias, the residual added after, RoPE and SwiGLU
    as torch's formulas; the same bits as that order written out."""
    t = {k: None if v is None else v.to(dtype) for k, v in _layer().items()}
    x, o, cos, sin = (a.to(dtype) for a in _inputs())
    w = LayerWeights(**t)

    def norm(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        af = a.float()
        return weight * (af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + 1e-6)).to(a.dtype)

    def rope(a: torch.Tensor) -> torch.Tensor:
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return a * c + torch.cat((-a[..., D // 2 :], a[..., : D // 2]), -1) * s

    h = norm(x, t["input_norm"])
    q = norm(F.linear(h, t["q"], t["q_bias"]).view(-1, HEADS, D), t["q_norm"])
    k = norm(F.linear(h, t["k"], t["k_bias"]).view(-1, KV, D), t["k_norm"])
    v = F.linear(h, t["v"], t["v_bias"]).view(-1, KV, D)
    got = pre_attention(x, w, cos, sin, 1e-6, HEADS, KV, D, TORCH_OPS)
    for a, b in zip(got, (rope(q), rope(k), v), strict=True):
        assert torch.equal(a, b)
    r = x + F.linear(o, t["o"])
    h = norm(r, t["mlp_norm"])
    want = r + F.linear(F.silu(F.linear(h, t["gate"])) * F.linear(h, t["up"]), t["down"])
    out, routed = post_attention(x, o, w, 1e-6, TORCH_OPS)
    assert routed is None and torch.equal(out, want)
    head = t["gate"][:, :HIDDEN]  # any [vocab, hidden] weight
    assert torch.equal(lm_head(x, t["mlp_norm"], 1e-6, head), F.linear(norm(x, t["mlp_norm"]), head).float())


def test_batch_invariant_ops_run_their_kernels_and_fused_projections_keep_the_bits() -> None:
    """Batch-invariant ops: the bias and the residual after the product, each rounded; megatron's fused
    qkv and [gate; up] give the separate projections' bits."""
    t = _layer(1)
    x, o, cos, sin = _inputs(37)
    sep, fused = LayerWeights(**t), _fused(t)
    h = bi.rms_norm(x, t["input_norm"], 1e-6)
    q = bi.rms_norm(bi.linear(h, t["q"], t["q_bias"]).view(-1, HEADS, D), t["q_norm"], 1e-6)
    k = bi.rms_norm(bi.linear(h, t["k"], t["k_bias"]).view(-1, KV, D), t["k_norm"], 1e-6)
    v = bi.linear(h, t["v"], t["v_bias"]).view(-1, KV, D)
    want = (bi.rope(q, cos, sin), bi.rope(k, cos, sin), v)
    for w in (sep, fused):
        got = pre_attention(x, w, cos, sin, 1e-6, HEADS, KV, D, BATCH_INVARIANT_OPS)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    r = bi.linear(o, t["o"], residual=x)
    h = bi.rms_norm(r, t["mlp_norm"], 1e-6)
    want_x = bi.linear(bi.silu_mul(bi.linear(h, t["gate"]), bi.linear(h, t["up"])), t["down"], residual=r)
    for w in (sep, fused):
        out, routed = post_attention(x, o, w, 1e-6, BATCH_INVARIANT_OPS)
        assert routed is None and torch.equal(out, want_x)
    head = t["gate"][:, :HIDDEN]
    want_logits = bi.linear(bi.rms_norm(x, t["mlp_norm"], 1e-6), head).float()
    assert torch.equal(lm_head(x, t["mlp_norm"], 1e-6, head, BATCH_INVARIANT_OPS), want_logits)


def test_a_mixture_of_experts_layer_reports_its_routing() -> None:
    t = _layer(2, bias=False)
    x, o, _, _ = _inputs(23)
    g = torch.Generator().manual_seed(3)
    experts = Experts(
        _rand(8, HIDDEN, g=g), _rand(8, 2 * FFN, HIDDEN, g=g), _rand(8, HIDDEN, FFN, g=g), 2, True
    )
    w = LayerWeights(**{**t, "gate": None, "up": None, "down": None, "experts": experts})
    out, routed = post_attention(x, o, w, 1e-6)
    r = x + F.linear(o, t["o"])
    h = bi.torch_rms_norm(r, t["mlp_norm"], 1e-6)
    y, ids = moe_mlp(h, experts, experts_grouped)
    assert torch.equal(out, r + y) and torch.equal(routed, ids)
    assert routed.dtype == torch.int32 and routed.shape == (23, 2)
    assert torch.equal(routed.long(), route(h, experts.router, 2, True)[1])
    with pytest.raises(ValueError, match="dense layers only"):
        post_attention(x, o, w, 1e-6, BATCH_INVARIANT_OPS)
