"""Grouped-GEMM experts (:class:`agentrl.trainer.experts.GroupedExperts`) against megatron-core's
``SequentialMLP`` on CPU in fp32: the module and a whole model give the same outputs and gradients on the
same weights (≤ 1e-5), HF <-> Megatron conversion in the stacked layout is bit-exact for tensor- and
expert-parallel layouts (a shape that does not fit names the tensor), the trainer with grouped experts
matches transformers and replays routing, two gloo expert-parallel ranks with grouped experts match one
rank with sequential ones, and on a GPU the ``torch._grouped_mm`` path matches
the per-expert loop in bf16."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from _trainer_helpers import make_trajectories, moe_expert_parallel_worker, spawn_ranks

from agentrl.trainer.model import (
    ModelArch,
    build_gpt_model,
    hf_to_mcore_shards,
    load_hf_state_dict,
    mcore_to_hf,
)
from agentrl.trainer.moe import expert_layout, stack_experts, unstack_experts

MOE = {"num_experts": 8, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3_moe", initializer_range=0.2, **MOE)


def _models(model_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same weights in a SequentialMLP model and a GroupedExperts model (one rank, fp32)."""
    arch = ModelArch.from_hf_dir(model_dir)
    hf = load_hf_state_dict(model_dir)
    out = []
    for grouped in (False, True):
        model = build_gpt_model(arch, grouped_experts=grouped)
        shard = hf_to_mcore_shards(hf, arch, grouped_experts=grouped)[(0, 0)]
        model.load_state_dict(shard, strict=False)
        out.append(model)
    return out[0], out[1]


def _permuted_inputs(experts: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 9, (experts,), generator=g)
    counts[1] = 0  # an expert no token went to
    x = torch.randn(int(counts.sum()), hidden, generator=g)
    probs = torch.rand(x.shape[0], generator=g)
    return x, counts, probs


# ---------------------------------------------------------------------------------- the module
def test_grouped_experts_equal_sequential_forward_and_grads(megatron_single_rank, moe_dir: Path) -> None:
    from agentrl.trainer.experts import GroupedExperts

    seq_model, grp_model = _models(moe_dir)
    seq, grp = seq_model.decoder.layers[0].mlp.experts, grp_model.decoder.layers[0].mlp.experts
    assert isinstance(grp, GroupedExperts) and type(seq).__name__ == "SequentialMLP"
    assert not hasattr(grp, "local_experts") and grp.fc1_weight.shape[0] == 8
    x, counts, probs = _permuted_inputs(8, grp.fc1_weight.shape[2], seed=0)
    outs, grads = [], []
    for mod in (seq, grp):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, bias = mod(xi, counts, pi)
        assert bias is None
        (y * torch.linspace(-1, 1, y.shape[1])).sum().backward()
        w = {n: p.grad for n, p in mod.named_parameters()}
        outs.append(y.detach())
        grads.append((xi.grad, pi.grad, stack_experts({f"layer.mlp.experts.{n}": g for n, g in w.items()})))
    assert outs[0].abs().max() > 0.1 and (outs[0] - outs[1]).abs().max() <= 1e-5
    (gx0, gp0, gw0), (gx1, gp1, gw1) = grads
    assert (gx0 - gx1).abs().max() <= 1e-5 and (gp0 - gp1).abs().max() <= 1e-5
    assert set(gw0) == set(gw1) == {"layer.mlp.experts.fc1_weight", "layer.mlp.experts.fc2_weight"}
    for k in gw0:
        assert gw0[k].abs().max() > 0 and (gw0[k] - gw1[k]).abs().max() <= 1e-5, k
    assert torch.equal(
        gw1["layer.mlp.experts.fc1_weight"][1], torch.zeros_like(gw1["layer.mlp.experts.fc1_weight"][1])
    )


def test_grouped_expert_weights_are_marked_like_megatrons(megatron_single_rank, moe_dir: Path) -> None:
    _, grp_model = _models(moe_dir)
    grp = grp_model.decoder.layers[0].mlp.experts
    for w in (grp.fc1_weight, grp.fc2_weight):
        # ep = 1: reduced over data parallel like any weight; sharded over expert TP
        assert w.allreduce is True and w.tensor_model_parallel is True


def test_grouped_model_equals_sequential_model(megatron_single_rank, moe_dir: Path) -> None:
    seq_model, grp_model = _models(moe_dir)
    arch = ModelArch.from_hf_dir(moe_dir)
    ids = torch.randint(0, arch.vocab_size, (3, 21), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    logits = []
    for model in (seq_model, grp_model):
        out = model(ids, pos, None)[..., : arch.vocab_size]
        torch.log_softmax(out, -1)[..., 7].sum().backward()
        logits.append(out.detach())
    assert (logits[0] - logits[1]).abs().max() <= 1e-5
    seq_grads = stack_experts({n: p.grad for n, p in seq_model.named_parameters()})
    grp_grads = {n: p.grad for n, p in grp_model.named_parameters()}
    assert set(seq_grads) == set(grp_grads)
    for n, g in grp_grads.items():
        assert (seq_grads[n] - g).abs().max() <= 1e-5, n


# ---------------------------------------------------------------------------------- conversion
@pytest.mark.parametrize(("tp", "pp", "ep"), [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 2, 4)])
def test_grouped_hf_mcore_hf_round_trip_bit_exact(moe_dir: Path, tp: int, pp: int, ep: int) -> None:
    arch = ModelArch.from_hf_dir(moe_dir)
    hf = load_hf_state_dict(moe_dir)
    seq = hf_to_mcore_shards(hf, arch, tp=tp, pp=pp, ep=ep, vocab_divisible_by=8)
    grp = hf_to_mcore_shards(hf, arch, tp=tp, pp=pp, ep=ep, vocab_divisible_by=8, grouped_experts=True)
    assert set(grp) == set(seq)
    last = (0, tp - 1) if ep == 1 else (0, tp - 1, ep - 1)
    local = grp[last]
    assert not any(".local_experts." in k for k in local)
    fc1, fc2 = (
        local["decoder.layers.0.mlp.experts.fc1_weight"],
        local["decoder.layers.0.mlp.experts.fc2_weight"],
    )
    f, h = arch.moe.ffn_hidden_size // tp, arch.hidden_size
    assert fc1.shape == (8 // ep, 2 * f, h) and fc2.shape == (8 // ep, h, f)
    # stacked expert j is the per-expert layout's local expert j, bit for bit, both ways
    for key in seq:
        assert expert_layout(seq[key], grouped=True).keys() == grp[key].keys()
        for k, v in expert_layout(seq[key], grouped=True).items():
            assert torch.equal(v, grp[key][k]), k
        back = unstack_experts(grp[key])
        assert back.keys() == seq[key].keys() and all(torch.equal(back[k], seq[key][k]) for k in back)
    e = 8 - 8 // ep  # the first expert of the last expert-parallel rank
    gate = hf[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"]
    assert torch.equal(fc1[0, :f], gate[(tp - 1) * f : tp * f])
    out = mcore_to_hf(grp, arch)
    assert set(out) == set(hf)
    for k, v in hf.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


def test_grouped_layout_names_the_expert_tensor_that_does_not_fit(
    moe_dir: Path, megatron_single_rank
) -> None:
    from agentrl.trainer.checkpoint import load_local_state

    arch = ModelArch.from_hf_dir(moe_dir)
    hf = load_hf_state_dict(moe_dir)
    bad = dict(hf)
    bad["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(5, 5)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight: shape \(5, 5\)"
    ):
        hf_to_mcore_shards(bad, arch, grouped_experts=True)
    seq = hf_to_mcore_shards(hf, arch)[(0, 0)]
    odd = dict(seq)
    name = "decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"
    odd[name] = odd[name][:, :-1]
    with pytest.raises(ValueError, match=rf"{name.replace('.', chr(92) + '.')}: shape"):
        stack_experts(odd)
    # a stacked shard of another expert size than the model: the model's loader names the tensor
    model = build_gpt_model(arch, grouped_experts=True)
    shard = hf_to_mcore_shards(hf, arch, grouped_experts=True)[(0, 0)]
    shard["decoder.layers.1.mlp.experts.fc1_weight"] = shard["decoder.layers.1.mlp.experts.fc1_weight"][:4]
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.mlp\.experts\.fc1_weight: checkpoint shape"):
        load_local_state(model, shard)


# ---------------------------------------------------------------------------------- trainer, expert parallel
def test_grouped_expert_parallel_two_ranks_match_sequential_one(moe_dir: Path, tmp_path: Path) -> None:
    # two gloo ranks with grouped experts, 4 of the 8 each, give one rank's SequentialMLP step

    runs = {}
    for world, grouped in ((1, False), (2, True)):
        out = tmp_path / f"ep{world}.pt"
        spawn_ranks(moe_expert_parallel_worker, world, str(moe_dir), str(out), grouped)
        runs[world] = torch.load(out, weights_only=False)
    one, two = runs[1], runs[2]
    assert one["stacked"] == [] and len(two["stacked"]) == 2 and two["stacked"][0][0] == 4
    for k in ("loss", "grad_norm", "mismatch_kl"):
        assert abs(one["metrics"][k] - two["metrics"][k]) <= 1e-5, k
    assert set(one["weights"]) == set(two["weights"])
    for k, w in one["weights"].items():
        assert (w - two["weights"][k]).abs().max() <= 1e-4, k


def test_trainer_with_grouped_experts_matches_transformers_and_replays_routing(moe_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from agentrl.models.moe import encode_routed_experts
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.moe import record_routing
    from agentrl.trainer.trainer import MegatronTrainer

    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cfg = TrainerConfig(model_path=str(moe_dir), lr=1e-3, micro_batch_size=2, moe={"grouped_gemm": True})
    tr = MegatronTrainer(cfg)
    try:
        assert tr.grouped_experts and hasattr(tr.module.decoder.layers[0].mlp.experts, "fc1_weight")
        trajs = make_trajectories(tr.arch.vocab_size, seed=3)
        ref = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
        for t, lp in zip(trajs, tr.compute_logprobs(trajs), strict=True):
            with torch.no_grad():
                logits = ref(torch.tensor([t.input_ids])).logits[0, len(t.prompt_ids) - 1 : -1]
            theirs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
            assert (torch.tensor(lp) - theirs).abs().max() <= 1e-4
        # routing replay works the same with grouped experts: the trainer's own routing replayed gives
        # its logprobs, other experts forced give others
        t = trajs[0]
        with record_routing(tr.module) as chosen:
            (own,) = tr.compute_logprobs([t])
        routed = torch.stack(chosen, 1).to(torch.int32)
        tr.replay_routing = True
        t.routed_experts = encode_routed_experts(routed)
        (again,) = tr.compute_logprobs([t])
        t.routed_experts = encode_routed_experts((routed + 1) % 8)
        (other,) = tr.compute_logprobs([t])
        assert again == own and other != own
        for t, lp in zip(trajs, tr.compute_logprobs(trajs), strict=True):
            t.rollout_logprobs = [x * m for x, m in zip(lp, t.loss_mask, strict=True)]
        metrics = tr.train_step(trajs)
        assert metrics["mismatch_kl"] <= 1e-8 and all(
            torch.isfinite(torch.tensor(v)) for v in metrics.values()
        )
    finally:
        tr.shutdown()


def test_layer_spec_places_grouped_experts_in_builder_style_specs(
    moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Newer megatron-core builds a layer's MoE as ``partial(MoELayer, submodules=MoESubmodules(...))``
    with builders instead of ModuleSpecs; the grouped experts go into that partial's submodules."""
    import functools
    from types import SimpleNamespace

    import megatron.core.models.gpt.gpt_layer_specs as specs

    from agentrl.trainer.experts import GroupedExperts
    from agentrl.trainer.model import layer_spec

    moe_subs = SimpleNamespace(experts="SequentialMLP builder", router="TopKRouter")
    built = SimpleNamespace(
        submodules=SimpleNamespace(
            self_attention=SimpleNamespace(submodules=SimpleNamespace(core_attention=None)),
            mlp=functools.partial(lambda **kw: kw, submodules=moe_subs),
        )
    )
    monkeypatch.setattr(specs, "get_gpt_layer_local_spec", lambda **kw: built)
    spec = layer_spec(ModelArch.from_hf_dir(moe_dir), grouped_experts=True)
    assert spec.submodules.mlp.keywords["submodules"].experts is GroupedExperts
    assert moe_subs.router == "TopKRouter"


def test_grouped_gemm_auto_is_sequential_on_cpu(moe_dir: Path) -> None:
    from agentrl.trainer.config import TrainerConfig

    assert TrainerConfig(model_path=str(moe_dir)).moe.grouped_gemm == "auto"
    assert TrainerConfig(model_path=str(moe_dir), moe={"grouped_gemm": "true"}).moe.grouped_gemm is True
    with pytest.raises(ValueError, match="grouped_gemm"):
        TrainerConfig(model_path=str(moe_dir), moe={"grouped_gemm": "sometimes"})


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_grouped_mm_equals_the_expert_loop_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 on an sm90 GPU: torch._grouped_mm over the stacked weights against the per-expert loop over
    # the same weights (forward and gradients), an expert with no tokens included
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    import agentrl.trainer.experts as experts

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=256,
        num_attention_heads=4,
        ffn_hidden_size=512,
        moe_ffn_hidden_size=384,
        num_moe_experts=16,
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        params_dtype=torch.bfloat16,
        bf16=True,
        perform_initialization=True,
        init_method_std=0.05,
        use_cpu_initialization=True,
    )
    mod = experts.GroupedExperts(16, cfg).cuda()
    x, counts, probs = _permuted_inputs(16, 256, seed=2)
    x = x.repeat(16, 1).to("cuda", torch.bfloat16)  # a few hundred rows
    counts, probs = counts * 16, probs.repeat(16).cuda()
    assert experts.grouped_mm_supported(x, mod.fc1_weight, mod.fc2_weight)
    runs = []
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(experts, "grouped_mm_supported", lambda *a: False)
        mod.zero_grad()
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, _ = mod(xi, counts, pi)
        y.float().square().mean().backward()
        runs.append(
            [t.float() for t in (y.detach(), xi.grad, pi.grad, mod.fc1_weight.grad, mod.fc2_weight.grad)]
        )
    for a, b in zip(*runs, strict=True):
        assert a.abs().max() > 0
        assert ((a - b).norm() / a.norm()).item() < 2e-2
