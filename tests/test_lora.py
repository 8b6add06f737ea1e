"""LoRA in the trainer on CPU: the config's checks, adapters that leave the model unchanged at step 0, a
train step that moves only the adapters (the base bit-identical, optimizer state for the adapters only),
the PEFT export loaded by ``peft`` into the transformers model giving the trainer's logprobs, and two
tensor-parallel ranks giving one rank's logprobs, update and exported adapters."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from _trainer_helpers import dist_env, make_trajectories, offset_rollout_logprobs, spawn_ranks

from agentrl.config import ConfigError
from agentrl.recipe import load_run_config

CPU_RUN = ["model_path=/m", "data.path=/d", "env.name=math"]


def _trainer(model_dir: Path, **kw):
    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    return MegatronTrainer(TrainerConfig(model_path=str(model_dir), **kw))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.lora.rank=0"], "trainer.lora.rank"),
        (["trainer.lora.target_modules=[q_proj,qkv]"], "trainer.lora.target_modules: unknown qkv"),
        (
            ["trainer.lora.rank=8", "trainer.true_on_policy=true"],
            "trainer.true_on_policy: not with trainer.lora",
        ),
        (
            ["trainer.lora.rank=8", "deterministic=true"],
            "deterministic: not with trainer.lora: the engines apply the adapters",
        ),
        (
            ["trainer.lora.dropout=0.1", "trainer.tp=2", "trainer_world_size=2"],
            "trainer.lora.dropout: needs trainer.tp = 1",
        ),
    ],
)
def test_bad_lora_config_names_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, CPU_RUN + overrides)


def test_lora_config_defaults_and_override() -> None:
    assert load_run_config(None, CPU_RUN).trainer.lora is None
    lora = load_run_config(None, [*CPU_RUN, "trainer.lora.rank=8"]).trainer.lora
    assert lora is not None and lora.rank == 8 and lora.alpha == 16.0
    assert lora.target_modules == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]


def test_trainer_refuses_lora_with_deterministic(tiny_model_dir: Path) -> None:
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(model_path=str(tiny_model_dir), lora={"rank": 4})
    with pytest.raises(ValueError, match=r"deterministic: not with trainer\.lora"):
        MegatronTrainer(cfg, deterministic=True)


def _hf_logprobs(model: torch.nn.Module, trajs) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logits = model(input_ids=ids).logits[0].float()
            p, r = len(t.prompt_ids), len(t.response_ids)
            lp = torch.log_softmax(logits[p - 1 : p - 1 + r], dim=-1)
            out.append(lp.gather(1, torch.tensor(t.response_ids)[:, None])[:, 0])
    return out


def test_lora_step_trains_only_the_adapters_and_exports_to_peft(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agentrl.trainer.lora import lora_parameters

    base = _trainer(tiny_model_dir)
    trajs = make_trajectories(base.arch.vocab_size, seed=3)
    base_lp = base.compute_logprobs(trajs)
    base.shutdown()

    tr = _trainer(tiny_model_dir, lr=1e-2, micro_batch_size=2, lora={"rank": 4, "alpha": 8})
    try:
        adapters = lora_parameters(tr.module)
        arch = tr.arch
        q, kv, h, f = (
            arch.num_attention_heads * arch.head_dim,
            arch.num_kv_heads * arch.head_dim,
            arch.hidden_size,
            arch.ffn_hidden_size,
        )
        per_layer = 4 * (h + q + 2 * kv) + 4 * (q + h) + 4 * (h + 2 * f) + 4 * (f + h)
        assert sum(p.numel() for p in adapters.values()) == arch.num_layers * per_layer
        assert {n for n, p in tr.module.named_parameters() if p.requires_grad} == set(adapters)
        assert tr.compute_logprobs(trajs) == base_lp  # B = 0: the base model bit for bit

        frozen = {n: p.detach().clone() for n, p in tr.module.named_parameters() if n not in adapters}
        before = {n: p.detach().clone() for n, p in adapters.items()}
        offset_rollout_logprobs(trajs, base_lp)
        tr.train_step(trajs)
        for n, p in adapters.items():  # B = 0 gives A no gradient in the first step
            assert torch.equal(p, before[n]) == n.endswith("lora_A"), n
        tr.train_step(trajs)
        for n, p in tr.module.named_parameters():
            if n in adapters:
                assert not torch.equal(p, before[n]), n
            else:
                assert torch.equal(p, frozen[n]), n
        state = tr.optim.optimizer.state
        assert {id(p) for p in state} == {id(p) for p in adapters.values()}

        peft_dir = tr.save_lora(tmp_path / "adapter")
        assert {p.name for p in peft_dir.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
        trained = tr.compute_logprobs(trajs)
        assert trained != base_lp
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        model = PeftModel.from_pretrained(hf, str(peft_dir)).eval()
        for ours, theirs in zip(trained, _hf_logprobs(model, trajs), strict=True):
            torch.testing.assert_close(torch.tensor(ours), theirs, atol=2e-5, rtol=0)
    finally:
        tr.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_some_targets_of_a_fused_layer(arch: str, tiny_model_factory, tmp_path: Path) -> None:
    # q and up only: the k/v rows of the fused qkv adapter and the gate rows of fc1 stay zero and are not
    # exported; the exported adapter still gives the trainer's logprobs in transformers + peft (Qwen3's
    # q/k norms, Llama's layout)
    tiny_model_dir = tiny_model_factory(arch)
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    lora = {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "up_proj", "o_proj"]}
    tr = _trainer(tiny_model_dir, lr=1e-2, micro_batch_size=2, lora=lora)
    try:
        trajs = make_trajectories(tr.arch.vocab_size, seed=4)
        offset_rollout_logprobs(trajs, tr.compute_logprobs(trajs))
        tr.train_step(trajs)
        peft_dir = tr.save_lora(tmp_path / "adapter")
        names = load_file(str(peft_dir / "adapter_model.safetensors"))
        modules = {n.split(".")[-3] for n in names}
        assert modules == {"q_proj", "up_proj", "o_proj"}
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        model = PeftModel.from_pretrained(hf, str(peft_dir)).eval()
        for ours, theirs in zip(tr.compute_logprobs(trajs), _hf_logprobs(model, trajs), strict=True):
            torch.testing.assert_close(torch.tensor(ours), theirs, atol=2e-5, rtol=0)
    finally:
        tr.shutdown()


def _random_peft(model_dir: str, rank: int) -> dict[str, torch.Tensor]:
    """A full PEFT state dict of random adapters (B not zero) for every target of the tiny model."""
    from agentrl.trainer.arch import ModelArch
    from agentrl.trainer.model import hf_param_shapes

    arch = ModelArch.from_hf_dir(model_dir)
    g = torch.Generator().manual_seed(7)
    out = {}
    for name, shape in hf_param_shapes(arch).items():
        if name.endswith("_proj.weight"):
            stem = "base_model.model." + name.removesuffix(".weight")
            out[stem + ".lora_A.weight"] = torch.randn(rank, shape[1], generator=g) * 0.1
            out[stem + ".lora_B.weight"] = torch.randn(shape[0], rank, generator=g) * 0.1
    # one A per fused layer: q/k/v share q's, gate/up share gate's
    for name in list(out):
        for shared, first in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
            if f".{shared}.lora_A" in name:
                out[name] = out[name.replace(shared, first)]
    return out


def _tp_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    dist_env(rank, world, port)
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.lora import load_peft_state_dict, peft_state_dict
    from agentrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(
        model_path=model_dir,
        tp=world,
        lr=1e-2,
        grad_clip=0.5,
        micro_batch_size=2,
        vocab_divisible_by=4,
        lora={"rank": 4, "alpha": 8},
    )
    tr = MegatronTrainer(cfg)
    init = peft_state_dict(tr.module, tr.arch, cfg.lora, tr.ps)  # the initial adapters, gathered
    load_peft_state_dict(tr.module, _random_peft(model_dir, 4), tr.arch, world, tr.tp_rank)
    trajs = make_trajectories(tr.arch.vocab_size, seed=5)
    lp = tr.compute_logprobs(trajs)
    offset_rollout_logprobs(trajs, lp)
    metrics = tr.train_step(trajs)
    trained = peft_state_dict(tr.module, tr.arch, cfg.lora, tr.ps)
    # the merged weights on rank 0; the other rank takes part in both gathers and keeps nothing
    merged = tr.hf_state_dict("cpu" if rank == 0 else None)
    assert rank == 0 or merged == {}, f"rank {rank} kept {len(merged)} tensors"
    if rank == 0:
        saved = {"init": init, "logprobs": lp, "metrics": metrics, "trained": trained}
        torch.save({**saved, "merged": merged}, out)
    tr.shutdown()


def _run_tp(world: int, model_dir: Path, out: Path) -> dict:
    spawn_ranks(_tp_worker, world, str(model_dir), str(out))
    return torch.load(out, weights_only=False)


def test_tp2_matches_tp1(tiny_model_dir: Path, tmp_path: Path) -> None:
    one = _run_tp(1, tiny_model_dir, tmp_path / "tp1.pt")
    two = _run_tp(2, tiny_model_dir, tmp_path / "tp2.pt")
    assert one["init"].keys() == two["init"].keys()
    for name, a in one["init"].items():
        assert torch.equal(a, two["init"][name]), name  # the same adapters at start, whatever the split
    for a, b in zip(one["logprobs"], two["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for key in ("loss", "grad_norm"):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-5, abs=1e-6), key
    for name, a in one["trained"].items():
        torch.testing.assert_close(a, two["trained"][name], atol=1e-5, rtol=0)
    assert one["merged"].keys() == two["merged"].keys()
    for name, a in one["merged"].items():
        torch.testing.assert_close(a, two["merged"][name], atol=1e-5, rtol=0)


def test_checkpoint_resumes_the_adapters(tiny_model_dir: Path, tmp_path: Path) -> None:
    # a LoRA trainer's checkpoint restores its adapters and their optimizer state: the next step after
    # the resume equals the next step of the trainer that never stopped
    kw = {"lr": 1e-2, "micro_batch_size": 2, "lora": {"rank": 4, "alpha": 8}}
    trajs = make_trajectories(600, seed=6)
    tr = _trainer(tiny_model_dir, **kw)
    offset_rollout_logprobs(trajs, tr.compute_logprobs(trajs))
    tr.train_step(trajs)
    tr.save_checkpoint(tmp_path / "ckpt")
    tr.train_step(trajs)
    expected = tr.lora_state_dict()
    tr.shutdown()

    resumed = _trainer(tiny_model_dir, **kw)
    try:
        assert resumed.load_checkpoint(tmp_path / "ckpt") == 1
        resumed.train_step(trajs)
        got = resumed.lora_state_dict()
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    finally:
        resumed.shutdown()
    full = _trainer(tiny_model_dir)  # a full fine-tuning trainer refuses the LoRA checkpoint, naming why
    try:
        with pytest.raises(KeyError, match=r"unexpected .*adapter\.lora_"):
            full.load_checkpoint(tmp_path / "ckpt")
    finally:
        full.shutdown()


def test_kl_reference_is_the_base_model(tiny_model_dir: Path) -> None:
    # the reference model carries no adapters: the KL to it is 0 while B is 0 and grows once it is not
    tr = _trainer(
        tiny_model_dir,
        lr=1e-2,
        micro_batch_size=2,
        lora={"rank": 4},
        loss={"kl_coef": 0.5, "kl_estimator": "k3"},
    )
    try:
        assert tr.ref_model is not None
        assert not any(".adapter." in n for n, _ in tr.ref_model.named_parameters())
        trajs = make_trajectories(600, seed=8)
        offset_rollout_logprobs(trajs, tr.compute_logprobs(trajs))
        assert tr.train_step(trajs)["ref_kl"] == 0.0
        assert tr.train_step(trajs)["ref_kl"] > 0.0
    finally:
        tr.shutdown()
