"""Mixture-of-experts models (Qwen3-MoE) through every part, on CPU in fp32: the tiny MoE model, HF <->
Megatron weights bit-exact for tensor- and expert-parallel layouts (a wrong expert count or shape names the
tensor; unsupported MoE families are refused by name), megatron-core's MoE layer against transformers
(≤ 1e-4), the embedded engine's grouped experts against transformers teacher-forced (≤ 1e-4, batch-correct)
with the routed experts it reports, weight updates by per-expert names, and the trainer: logprobs equal to
transformers', the load-balancing loss logged, a GSPO step, and routing replay in π_old and the loss."""

from __future__ import annotations

import asyncio
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from _trainer_helpers import make_trajectories, moe_expert_parallel_worker, spawn_ranks

from agentrl.models.moe import decode_routed_experts, encode_routed_experts
from agentrl.trainer.model import (
    LazyHFStateDict,
    ModelArch,
    build_gpt_model,
    hf_param_shapes,
    hf_to_mcore_shards,
    load_hf_state_dict,
    mcore_to_hf,
)

MOE = {"num_experts": 8, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3_moe", **MOE)


# ---------------------------------------------------------------------------------- model and weights
def test_tiny_moe_model_is_a_standard_hf_checkpoint(moe_dir: Path) -> None:
    cfg = json.loads((moe_dir / "config.json").read_text())
    n = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 writes num_local_experts
    assert cfg["model_type"] == "qwen3_moe" and n == 8 and cfg["num_experts_per_tok"] == 2
    arch = ModelArch.from_hf_dir(moe_dir)
    assert arch.moe is not None and arch.moe.topk == 2 and arch.qk_norm and not arch.qkv_bias
    hf = load_hf_state_dict(moe_dir)
    assert {k: tuple(v.shape) for k, v in hf.items()} == hf_param_shapes(arch)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf
    assert arch.num_params(active=True) < arch.num_params() == sum(v.numel() for v in hf.values())


@pytest.mark.parametrize(("tp", "pp", "ep"), [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 2, 4)])
def test_moe_hf_mcore_hf_round_trip_bit_exact(moe_dir: Path, tp: int, pp: int, ep: int) -> None:
    arch = ModelArch.from_hf_dir(moe_dir)
    hf = load_hf_state_dict(moe_dir)
    shards = hf_to_mcore_shards(hf, arch, tp=tp, pp=pp, ep=ep, vocab_divisible_by=8)
    keys = {(p, t) if ep == 1 else (p, t, e) for p in range(pp) for t in range(tp) for e in range(ep)}
    assert set(shards) == keys
    # expert-parallel rank e holds experts [e*E/ep, (e+1)*E/ep) as local experts 0..E/ep-1; TP splits
    # each expert's fc1 as [gate_t; up_t] and its fc2 by columns; the router is replicated
    last = (0, tp - 1) if ep == 1 else (0, tp - 1, ep - 1)
    local = shards[last]
    assert sum(".local_experts." in k and k.endswith("linear_fc1.weight") for k in local) == 8 // ep * (
        arch.num_layers // pp
    )
    e = 8 - 8 // ep  # the first expert of the last expert-parallel rank
    half = arch.moe.ffn_hidden_size // tp
    fc1 = local["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    gate = hf[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"]
    assert torch.equal(fc1[:half], gate[(tp - 1) * half : tp * half])
    assert torch.equal(local["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    back = mcore_to_hf(shards, arch)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


@pytest.mark.parametrize(("tp", "pp", "ep"), [(1, 1, 2), (2, 1, 2), (1, 2, 4)])
def test_a_rank_reads_only_its_share_of_the_checkpoint(moe_dir: Path, tp: int, pp: int, ep: int) -> None:
    """A rank's initial shard from the checkpoint read lazily (agentrl.trainer.build): the same tensors as
    from the whole checkpoint in memory, and no other rank's experts read."""
    arch = ModelArch.from_hf_dir(moe_dir)
    whole = hf_to_mcore_shards(load_hf_state_dict(moe_dir), arch, tp=tp, pp=pp, ep=ep, vocab_divisible_by=8)

    class Counting(LazyHFStateDict):
        read: list[str] = []

        def __getitem__(self, name: str) -> torch.Tensor:
            self.read.append(name)
            return super().__getitem__(name)

    rank = (pp - 1, tp - 1, ep - 1)
    lazy = Counting(moe_dir)
    mine = hf_to_mcore_shards(lazy, arch, tp=tp, pp=pp, ep=ep, vocab_divisible_by=8, ranks=[rank])[rank]
    assert mine.keys() == whole[rank].keys()
    assert all(torch.equal(v, whole[rank][k]) for k, v in mine.items())
    experts = [name for name in lazy.read if ".experts." in name]
    first, last = arch.layer_range(pp - 1, pp)
    assert len(experts) == len(set(experts)) == 3 * (8 // ep) * (last - first)  # gate, up, down each
    starts = {int(name.split(".experts.")[1].split(".")[0]) for name in experts}
    assert starts == set(range(8 - 8 // ep, 8))  # the last expert-parallel rank's experts only
    assert len(set(lazy.read)) < len(lazy)


def test_convert_cli_expert_parallel_round_trip(moe_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    mc, out = tmp_path / "mcore", tmp_path / "hf"
    for args in (
        ["hf-to-mcore", "--hf", str(moe_dir), "--out", str(mc), "--tp", "2", "--ep", "2"],
        ["mcore-to-hf", "--mcore", str(mc), "--hf-template", str(moe_dir), "--out", str(out)],
    ):
        subprocess.run([sys.executable, "-m", "agentrl.convert", *args], check=True, capture_output=True)
    assert sorted(p.name for p in mc.iterdir() if p.is_dir()) == [
        "mp_rank_00_000_000",
        "mp_rank_00_000_001",
        "mp_rank_01_000_000",
        "mp_rank_01_000_001",
    ]
    a, b = load_hf_state_dict(moe_dir), load_hf_state_dict(out)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_moe_conversion_names_the_tensor_that_does_not_fit(moe_dir: Path) -> None:
    arch = ModelArch.from_hf_dir(moe_dir)
    hf = load_hf_state_dict(moe_dir)
    missing = {k: v for k, v in hf.items() if not k.startswith("model.layers.1.mlp.experts.7.")}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.7\.gate_proj\.weight: missing"):
        hf_to_mcore_shards(missing, arch)
    extra = dict(hf)
    extra["model.layers.0.mlp.experts.8.gate_proj.weight"] = hf[
        "model.layers.0.mlp.experts.0.gate_proj.weight"
    ]
    with pytest.raises(ValueError, match=r"experts\.8\.gate_proj\.weight: more experts .* num_experts=8"):
        hf_to_mcore_shards(extra, arch)
    bad = dict(hf)
    bad["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(5, 5)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight: shape \(5, 5\)"
    ):
        hf_to_mcore_shards(bad, arch)
    with pytest.raises(ValueError, match="do not split over expert parallel size 3"):
        hf_to_mcore_shards(hf, arch, ep=3)


@pytest.mark.parametrize(
    ("model_type", "family"),
    [
        ("mixtral", "Mixtral"),
        ("deepseek_v3", "DeepSeek-V3"),
        ("qwen2_moe", "Qwen2-MoE"),
        ("newmoe", "newmoe"),
    ],
)
def test_unsupported_moe_families_are_refused_by_name(model_type: str, family: str) -> None:
    cfg = dict(
        model_type=model_type,
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
    )
    with pytest.raises(ValueError, match=f"{family} mixture-of-experts models .* not supported"):
        ModelArch.from_hf_config(cfg)


def test_engine_refuses_an_unsupported_moe_family() -> None:
    import transformers

    from agentrl.embedded.runner import ModelRunner

    cfg = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="Mixtral mixture-of-experts models"):
        ModelRunner(model, num_slots=2, context_len=32, max_batch=1)


# ---------------------------------------------------------------------------------- trainer's model
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatron_moe_logits_match_transformers(
    megatron_single_rank, tiny_model_factory, norm_topk_prob: bool
) -> None:
    from transformers import AutoModelForCausalLM

    # norm_topk_prob False: the gates are the full softmax at the k experts (megatron's pre-softmax)
    model_dir = tiny_model_factory("qwen3_moe", norm_topk_prob=norm_topk_prob, initializer_range=0.2, **MOE)
    arch = ModelArch.from_hf_dir(model_dir)
    model = build_gpt_model(arch, vocab_divisible_by=64)
    model.load_state_dict(
        hf_to_mcore_shards(load_hf_state_dict(model_dir), arch, vocab_divisible_by=64)[(0, 0)], strict=False
    )
    model.eval()
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, arch.vocab_size, (3, 29), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        ours = model(ids, pos, None)[..., : arch.vocab_size]
        theirs = ref(ids).logits
    assert theirs.abs().max() > 0.1
    assert (ours - theirs).abs().max().item() <= 1e-4


# ---------------------------------------------------------------------------------- engine
def test_engine_moe_forward_matches_transformers_and_reports_routing(moe_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from agentrl.embedded.runner import ExtendBatch, ModelRunner

    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    r = ModelRunner(hf, num_slots=4, context_len=128, max_batch=2)
    seq = list(range(20, 60))
    whole = r.extend(ExtendBatch([0], [seq], [0]))
    r.extend(ExtendBatch([1], [seq[:13]], [0]))
    parts = r.extend(ExtendBatch([1], [seq[13:]], [13]))
    assert torch.allclose(whole, parts, atol=1e-5)
    with torch.no_grad():
        out = hf(torch.tensor([[*seq, 77]]), output_router_logits=True)
    ref = out.logits[0].float()
    assert torch.allclose(whole[0], ref[-2], atol=1e-4)
    step = r.decode([77, 77], [40, 40])
    assert torch.allclose(step[0], ref[-1], atol=1e-4) and torch.allclose(step[1], ref[-1], atol=1e-4)
    # the experts of every position, as transformers' routers chose them
    theirs = torch.stack(
        [torch.topk(torch.softmax(x.float(), -1), 2, -1).indices for x in out.router_logits], 1
    )
    ours = r.routed_experts(0, 41)
    assert ours.shape == (41, arch_layers(hf), 2)
    assert torch.equal(ours.sort(-1).values, theirs.sort(-1).values.to(torch.int32))
    # batch-correct: a padded batch of unequal rows gives each row its own result
    mixed = r.extend(ExtendBatch([2, 3], [seq[:5], seq], [0, 0]))
    assert torch.allclose(mixed[1], whole[0], atol=1e-5)
    assert torch.equal(r.routed_experts(3, 40), r.routed_experts(0, 40))


def test_engine_sorted_experts_equal_grouped() -> None:
    # the CUDA-graph path (torch._grouped_mm over expert-sorted rows, no host sync) computes what the
    # eager path does
    from agentrl.models.decoder import experts_grouped, experts_sorted, route

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 32, generator=g)
    gate_up, down = torch.randn(8, 48, 32, generator=g) / 6, torch.randn(8, 32, 24, generator=g) / 5
    gates, ids = route(h, torch.randn(8, 32, generator=g), 2, True)
    a = experts_grouped(h, gates, ids, gate_up, down)
    b = experts_sorted(h, gates, ids, gate_up, down)
    assert a.abs().max() > 0.1 and (a - b).abs().max() <= 1e-5


def arch_layers(hf) -> int:
    return int(hf.config.num_hidden_layers)


def test_engine_weight_updates_reach_the_fused_experts(moe_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from agentrl.embedded.sampling import EngineBadRequest
    from agentrl.embedded.weights import check_weights, copy_weights

    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    sd = load_hf_state_dict(moe_dir)  # checkpoint names: one tensor per expert and projection
    new = {k: v + 1.0 for k, v in sd.items() if ".mlp.experts.5." in k or k.endswith("mlp.gate.weight")}
    check_weights(hf, new)
    copy_weights(hf, new)
    fused = hf.model.layers[1].mlp.experts
    i = fused.gate_up_proj.shape[1] // 2
    assert torch.equal(fused.gate_up_proj[5, :i], new["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(fused.gate_up_proj[5, i:], new["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(fused.down_proj[5], new["model.layers.1.mlp.experts.5.down_proj.weight"])
    assert torch.equal(fused.down_proj[4], sd["model.layers.1.mlp.experts.4.down_proj.weight"])
    with pytest.raises(
        EngineBadRequest, match=r"model\.layers\.0\.mlp\.experts\.8\.up_proj\.weight: unknown"
    ):
        check_weights(hf, {"model.layers.0.mlp.experts.8.up_proj.weight": torch.zeros(1)})
    with pytest.raises(EngineBadRequest, match=r"experts\.2\.down_proj\.weight: shape \(3,\)"):
        check_weights(hf, {"model.layers.0.mlp.experts.2.down_proj.weight": torch.zeros(3)})


async def test_moe_engine_sleep_releases_the_routed_experts_with_the_kv_cache(moe_dir: Path) -> None:
    """The per-position experts buffer is part of the KV cache: released and given back with it, and a
    request after the wake reports the same experts as before the sleep."""
    from agentrl.embedded.engine import EmbeddedEngine
    from agentrl.embedded.sampling import RequestSampling

    engine = EmbeddedEngine(moe_dir, max_batch_size=2, prefix_cache_slots=2)
    try:
        routed = engine.runner.routed
        kv = 2 * engine.runner.k.numel() * engine.runner.k.element_size()
        assert engine.memory.sizes["kv_cache"] == kv + routed.numel() * routed.element_size()
        prompt, sp = list(range(30, 47)), RequestSampling(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        before = await engine.generate(prompt, sp, "a")
        await engine.release_memory_occupation()
        assert routed.untyped_storage().size() == 0  # copy mode: the storage itself was given up
        await engine.resume_memory_occupation()
        assert routed.untyped_storage().size() > 0 and int(routed.max()) == -1  # nothing computed yet
        after = await engine.generate(prompt, sp, "b")
        assert after.output_ids == before.output_ids
        assert torch.equal(after.routed_experts, before.routed_experts)
    finally:
        engine.shutdown()


async def test_engine_returns_routed_experts_in_sglang_format(moe_dir: Path) -> None:
    from agentrl.embedded.engine import EmbeddedEngine
    from agentrl.embedded.native_api import NativeAPI  # noqa: F401  (the HTTP answer is covered below)
    from agentrl.embedded.sampling import RequestSampling

    engine = EmbeddedEngine(moe_dir, max_batch_size=2, prefix_cache_slots=4)
    try:
        prompt = list(range(30, 47))
        sp = RequestSampling(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        rec = await engine.generate(prompt, sp, "a")
        assert rec.routed_experts.shape == (len(prompt) + 6 - 1, 2, 2)  # every input position
        assert int(rec.routed_experts.min()) >= 0 and int(rec.routed_experts.max()) < 8
        # a next turn reusing the cached prefix reports the same experts for it
        rec2 = await engine.generate(prompt + rec.output_ids + [5, 6], sp, "b")
        assert rec2.cached_tokens > 0
        n = rec.routed_experts.shape[0]
        assert torch.equal(rec2.routed_experts[:n], rec.routed_experts)
        arr = decode_routed_experts(encode_routed_experts(rec2.routed_experts), 2, 2)
        assert arr.shape == tuple(rec2.routed_experts.shape)
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------------- trainer
@pytest.fixture
def dist_env_one():
    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def _trainer(model_dir: Path, **kw):
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    return MegatronTrainer(
        TrainerConfig(**{"model_path": str(model_dir), "lr": 1e-3, "micro_batch_size": 2, **kw})
    )


def _hf_logprobs(model_dir: Path, trajs) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for t in trajs:
        with torch.no_grad():
            logits = ref(torch.tensor([t.input_ids])).logits[0, len(t.prompt_ids) - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(t.response_ids)[:, None])
        out.append(lp.squeeze(-1).tolist())
    return out


def test_trainer_on_moe_matches_transformers_logs_aux_loss_and_runs_gspo(dist_env_one, moe_dir: Path) -> None:
    tr = _trainer(moe_dir, loss={"mode": "gspo"}, moe={"aux_loss_coef": 0.01})
    try:
        trajs = make_trajectories(tr.arch.vocab_size, seed=3)
        ours, theirs = tr.compute_logprobs(trajs), _hf_logprobs(moe_dir, trajs)
        worst = max(abs(a - b) for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True))
        assert worst <= 1e-4
        for t, lp in zip(trajs, ours, strict=True):
            t.rollout_logprobs = [x * m for x, m in zip(lp, t.loss_mask, strict=True)]
        router = tr.module.decoder.layers[0].mlp.router.weight.detach().clone()
        first = tr.train_step(trajs)
        assert first["ppo_kl"] == 0.0 and first["mismatch_kl"] <= 1e-8
        # megatron's load-balancing loss is E·Σ f_i P_i: about 1 for near-uniform tiny routers
        assert 0.5 < first["moe_aux_loss"] < 2.0
        assert not torch.equal(router, tr.module.decoder.layers[0].mlp.router.weight)  # the router learns
        second = tr.train_step(trajs)
        assert second["mismatch_kl"] > 0  # the weights moved; μ did not
        assert all(torch.isfinite(torch.tensor(v)) for v in second.values())
    finally:
        tr.shutdown()


def test_trainer_refuses_moe_options_on_a_dense_model(dist_env_one, tiny_model_dir: Path) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    try:
        with pytest.raises(ValueError, match="need a mixture-of-experts model"):
            _trainer(tiny_model_dir, moe={"routing_replay": True})
    finally:  # the refusal comes after the process group is up
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------- routing replay
async def _engine_rollouts(model_dir: Path, dtype: str, n: int, new_tokens: int) -> list:
    from agentrl.embedded.engine import EmbeddedEngine
    from agentrl.embedded.sampling import RequestSampling
    from agentrl.types import Trajectory

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 600, (12,), generator=g).tolist() for _ in range(n)]
    engine = EmbeddedEngine(model_dir, dtype=dtype, max_batch_size=n)
    try:
        sps = [
            RequestSampling(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, sampling_seed=i)
            for i in range(n)
        ]
        recs = await asyncio.gather(
            *(engine.generate(p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)))
        )
    finally:
        engine.shutdown()
    out = []
    for i, (p, rec) in enumerate(zip(prompts, recs, strict=True)):
        t = Trajectory(task_id=f"t{i}", group_id=f"g{i // 2}", prompt_ids=p, reward=float(i % 2))
        t.append_model_tokens(rec.output_ids, rec.logprobs, 0)
        t.routed_experts = encode_routed_experts(rec.routed_experts)
        out.append(t)
    return out


def _mismatch(trainer, trajs, replay: bool) -> tuple[float, float]:
    """(mismatch KL k3 of KL(μ‖π_old) as the trainer logs it, share of (token, layer) routed alike)."""
    from agentrl.trainer.moe import record_routing

    trainer.replay_routing = replay
    kl = n = same = total = 0.0
    for t in trajs:
        with record_routing(trainer.module) as chosen:
            (lp,) = trainer.compute_logprobs([t])
        d = torch.tensor(t.rollout_logprobs, dtype=torch.float64) - torch.tensor(lp, dtype=torch.float64)
        kl += float((torch.exp(-d) - 1 + d).sum())
        n += d.numel()
        engine = torch.from_numpy(decode_routed_experts(t.routed_experts, 2, 2).copy())
        ours = torch.stack(chosen, 1).to(engine.dtype)
        same += float((engine.sort(-1).values == ours.sort(-1).values).all(-1).sum())
        total += engine.shape[0] * engine.shape[1]
    return kl / n, same / total


async def test_routing_replay_removes_the_routing_mismatch(dist_env_one, moe_dir: Path) -> None:
    # a bf16 engine routes some tokens to other experts than the fp32 trainer (near-tied router logits);
    # replayed, the trainer's routers take the engine's experts and the mismatch KL drops
    trajs = await _engine_rollouts(moe_dir, "bfloat16", 16, 24)
    tr = _trainer(moe_dir, micro_batch_size=4, moe={"routing_replay": True})
    try:
        kl_own, agree_own = _mismatch(tr, trajs, replay=False)
        kl_replay, agree_replay = _mismatch(tr, trajs, replay=True)
        assert agree_replay == 1.0 and agree_own < 1.0
        assert kl_replay < kl_own
        # the train step replays too: its π_old (the update's own forward) gives the same mismatch
        tr.replay_routing = True
        metrics = tr.train_step(trajs)
        # (equal up to fp32 sums over other micro-batches: far nearer the replayed figure than the other)
        assert abs(metrics["mismatch_kl"] - kl_replay) < 0.1 * (kl_own - kl_replay)
    finally:
        tr.shutdown()


# ---------------------------------------------------------------------------------- expert parallelism
def test_expert_parallel_two_ranks_match_one(moe_dir: Path, tmp_path: Path) -> None:
    # two gloo ranks, each holding 4 of the 8 experts (and half the batch: data parallel for the rest),
    # give one rank's loss, gradient norm and update (micro-batches padded to one shape on both ranks)

    runs = {}
    for world in (1, 2):
        out = tmp_path / f"ep{world}.pt"
        spawn_ranks(moe_expert_parallel_worker, world, str(moe_dir), str(out), False)
        runs[world] = torch.load(out, weights_only=False)
    one, two = runs[1], runs[2]
    assert (one["local_experts"], two["local_experts"]) == (16, 8)  # 2 layers x 8 experts, split in two
    for k in ("loss", "grad_norm", "mismatch_kl"):
        assert abs(one["metrics"][k] - two["metrics"][k]) <= 1e-5, k
    assert set(one["weights"]) == set(two["weights"])
    for k, w in one["weights"].items():
        assert (w - two["weights"][k]).abs().max() <= 1e-4, k
    for run in (one, two):  # rank 0 gets every expert whether or not the other ranks keep theirs
        assert run["kept"].keys() == run["weights"].keys()
        assert all(torch.equal(run["kept"][k], w) for k, w in run["weights"].items())


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
async def test_moe_engine_cuda_graphs_on_gpu(tiny_model_factory) -> None:
    # bf16 on a GPU with CUDA graphs (the experts through torch._grouped_mm, no host sync): logprobs of
    # the sampled tokens within the bf16 gap of a teacher-forced transformers forward, routing reported
    from transformers import AutoModelForCausalLM

    from agentrl.embedded.engine import EmbeddedEngine
    from agentrl.embedded.sampling import RequestSampling

    model_dir = tiny_model_factory("qwen3_moe", dtype="bfloat16", **MOE)
    engine = EmbeddedEngine(model_dir, device="cuda", dtype="bfloat16", max_batch_size=8)
    try:
        assert engine.runner.cuda_graphs
        prompts = [list(range(30 + i, 50 + i)) for i in range(6)]
        sp = RequestSampling(temperature=1.0, max_new_tokens=16, ignore_eos=True, sampling_seed=3)
        recs = await asyncio.gather(*(engine.generate(p, sp, f"g{i}") for i, p in enumerate(prompts)))
    finally:
        engine.shutdown()
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    for p, rec in zip(prompts, recs, strict=True):
        ids = torch.tensor([p + rec.output_ids], device="cuda")
        with torch.no_grad():
            logits = ref(ids).logits[0, len(p) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(p) :, None]).squeeze(-1).cpu()
        assert (lp - torch.tensor(rec.logprobs)).abs().max() < 5e-2
        assert rec.routed_experts.shape == (len(p) + 16 - 1, 2, 2)
