"""LoRA with SGLang, on CPU: the launcher's flags, the run config's checks, and the adapter protocol against
the SGLang-protocol stand-in (:mod:`agentrl.testing.stub_engine` with ``enable_lora``, which keeps SGLang
0.5.16's adapter rules, :mod:`agentrl.testing.stub_lora`): each sync loads ``agentrl-v{version}`` and
unloads the one before, the clients name the adapter the engine serves, a request refused for a replaced
adapter is sent again under the new one, and requests interrupted by an update are resubmitted naming the
new adapter. Real SGLang: tests/test_gpu_sglang.py."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _trainer_helpers import make_trajectories, offset_rollout_logprobs

from agentrl.config import ConfigError
from agentrl.engine.adapters import adapter_name, adapter_version
from agentrl.engine.client import EngineClient, EngineRequestError
from agentrl.engine.launcher import SGLangConfig, SGLangLauncher, SGLangLoRAConfig
from agentrl.engine.types import SamplingParams
from agentrl.recipe import load_run_config
from agentrl.testing.stub_engine import stub_engine_in_process
from agentrl.testing.stub_lora import _TensorUnpickler
from agentrl.trainer.config import LoRAConfig
from agentrl.trainer.lora import PEFT_PREFIX, merge_into_hf, save_peft_dir
from agentrl.weight_sync import WeightUpdate
from agentrl.weight_sync.named_adapters import NamedAdapterSync, adapter_payload, complete_fused_groups

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
LORA_STUB = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=FUSED, max_loaded_loras=2)
SP = SamplingParams(max_new_tokens=4, temperature=1.0)
RUN = ["model_path=/m", "data.path=/d", "env.name=math", "trainer.lora.rank=8", "engine.backend=sglang"]


def _peft(modules: list[str], layers: int = 2, rank: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """A PEFT state dict of ``modules`` (as the trainer exports: one ``A`` per fused layer)."""
    g = torch.Generator().manual_seed(seed)
    rows = {
        "q_proj": 64,
        "k_proj": 32,
        "v_proj": 32,
        "o_proj": 64,
        "gate_proj": 96,
        "up_proj": 96,
        "down_proj": 64,
    }
    out = {}
    for i in range(layers):
        a = {"attn": torch.randn(rank, 64, generator=g), "mlp": torch.randn(rank, 64, generator=g)}
        for m in modules:
            part, prefix = (
                ("mlp", "mlp.") if m in ("gate_proj", "up_proj", "down_proj") else ("attn", "self_attn.")
            )
            stem = f"{PEFT_PREFIX}model.layers.{i}.{prefix}{m}"
            out[f"{stem}.lora_A.weight"] = (
                torch.randn(rank, 96, generator=g) if m == "down_proj" else a[part].clone()
            )
            out[f"{stem}.lora_B.weight"] = torch.randn(rows[m], rank, generator=g)
    return out


# ---------------------------------------------------------------------------------------- launcher
def test_launcher_flags_for_lora_and_fp8() -> None:
    lora = SGLangLoRAConfig.for_adapters(8, ALL)
    assert lora.target_modules == FUSED and (lora.max_loaded, lora.max_per_batch) == (2, 2)
    cmd = SGLangLauncher(SGLangConfig(model_path="m", python="py", lora=lora)).command()
    tail = cmd[cmd.index("--enable-lora") :]
    assert tail == [
        *"--enable-lora --max-lora-rank 8 --lora-target-modules".split(),
        *FUSED,
        *"--max-loras-per-batch 2 --max-loaded-loras 2".split(),
    ]
    partial = SGLangLoRAConfig.for_adapters(16, ["up_proj", "k_proj"])
    assert partial.target_modules == ["qkv_proj", "gate_up_proj"]  # the fused layers they are part of
    with pytest.raises(ValueError, match="q_proj are not SGLang module names"):
        SGLangLoRAConfig(max_rank=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="below max_per_batch"):
        SGLangLoRAConfig(max_rank=8, target_modules=FUSED, max_loaded=1)
    assert "--enable-lora" not in SGLangLauncher(SGLangConfig(model_path="m", python="py")).command()

    fp8 = SGLangLauncher(SGLangConfig(model_path="m", python="py", quantization="fp8")).command()
    assert fp8[fp8.index("--quantization") :] == ["--quantization", "fp8", "--load-format", "flash_rl"]
    own = SGLangConfig(model_path="m", python="py", quantization="fp8", extra_args={"load-format": "auto"})
    cmd = SGLangLauncher(own).command()
    assert cmd.count("--load-format") == 1 and cmd[cmd.index("--load-format") + 1] == "auto"


# ---------------------------------------------------------------------------------------- config
def _refused(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_run_config(None, overrides)
    return str(err.value)


def test_run_config_passes_lora_with_sglang_and_refuses_what_cannot_work() -> None:
    from agentrl.placement import engine_starter

    cfg = load_run_config(None, RUN)
    assert cfg.trainer.lora.rank == 8
    sg = engine_starter(cfg, "/m", 0).args[0]  # the SGLang launch settings the run starts its engines with
    assert sg.lora == SGLangLoRAConfig(max_rank=8, target_modules=FUSED)
    targets = load_run_config(None, [*RUN, "trainer.lora.target_modules=[q_proj,down_proj]"])
    assert engine_starter(targets, "/m", 0).args[0].lora.target_modules == ["qkv_proj", "down_proj"]
    for mode in ("disk", "distributed"):
        assert load_run_config(None, [*RUN, f"weight_sync={mode}"]).weight_sync == mode

    assert "trainer.lora: needs engine.backend: embedded or sglang" in _refused(
        [*RUN[:-1], "engine.backend=external", "engine.urls=[http://x:1]", "weight_sync=disk"]
    )
    assert "engine.sglang.lora: the run sets it from trainer.lora" in _refused(
        [*RUN, "engine.sglang={lora: {max_rank: 8, target_modules: [qkv_proj]}}"]
    )
    assert "engine.sglang.extra_args: dp-size 2" in _refused(
        [*RUN, "engine.sglang={extra_args: {dp-size: 2}}"]
    )
    colocated = [*RUN, "placement=colocated", "weight_sync=tensor", "trainer.device=cuda"]
    assert "colocation.engine_release: all releases SGLang's weights" in _refused(colocated)
    for fix in ("engine.sglang={weights_cpu_backup: true}", "colocation.engine_release=kv_cache"):
        assert load_run_config(None, [*colocated, fix]).trainer.lora is not None
    assert "not with trainer.lora" in _refused([*RUN, "deterministic=true"])


# ---------------------------------------------------------------------------------------- the stand-in
async def test_stand_in_keeps_sglangs_adapter_rules(tmp_path: Path) -> None:
    """What the stand-in answers is what SGLang 0.5.16's code does (agentrl.testing.stub_lora)."""
    lora = LoRAConfig(rank=2, alpha=4, target_modules=ALL)
    async with stub_engine_in_process(**LORA_STUB) as (engine, url), EngineClient(url) as c:
        disk = save_peft_dir(_peft(ALL), lora, tmp_path / "a", "/m")
        await c.load_lora_adapter("a", str(disk))
        assert engine.lora.loaded["a"].applied == set(FUSED)
        with pytest.raises(EngineRequestError, match="already loaded"):
            await c.load_lora_adapter("a", str(disk))
        config = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "k_proj"], "peft_type": "LORA"}
        qk = adapter_payload(_peft(["q_proj", "k_proj"]))
        with pytest.raises(EngineRequestError, match="v_proj"):  # SGLang stacks q/k/v from q and v
            await c.load_lora_adapter_from_tensors("qk", config, qk)
        up = adapter_payload(_peft(["up_proj", "o_proj"]))
        await c.load_lora_adapter_from_tensors("up", {**config, "target_modules": ["up_proj", "o_proj"]}, up)
        assert engine.lora.loaded["up"].applied == {"o_proj"}  # a lone up_proj is not applied
        wide = adapter_payload(_peft(["o_proj"], rank=16))
        with pytest.raises(EngineRequestError, match="incompatible"):
            await c.load_lora_adapter_from_tensors(
                "r16", {**config, "r": 16, "target_modules": ["o_proj"]}, wide
            )
        assert {a for names in (await c.loaded_adapters()).values() for a in names} == {"a", "up"}

        c.use_adapter("nope")
        with pytest.raises(EngineRequestError, match="never been loaded"):
            await c.generate([1, 2], SP)
        await c.unload_lora_adapter("up")
        with pytest.raises(EngineRequestError, match="does not exist"):
            await c.unload_lora_adapter("up")
        c.use_adapter("up")  # loaded from tensors, then unloaded: SGLang cannot load it again
        with pytest.raises(EngineRequestError, match="Failed to implicitly load"):
            await c.generate([1, 2], SP)
        await c.unload_lora_adapter("a")
        c.use_adapter("a")  # loaded from a dir that still exists: SGLang loads it again
        await c.generate([1, 2], SP)
        assert list(engine.lora.loaded) == ["a"] and engine.lora.log == ["a"]
    async with stub_engine_in_process() as (_, url), EngineClient(url) as c:  # LoRA off
        with pytest.raises(EngineRequestError, match="LoRA is not enabled"):
            await c.load_lora_adapter("a", str(disk))
        assert await c.serves_adapters_by_name() is False


# ---------------------------------------------------------------------------------------- the sync
@pytest.mark.parametrize("mode", ["tensor", "disk"])
async def test_each_sync_loads_a_new_name_and_unloads_the_last(tmp_path: Path, mode: str) -> None:
    lora = LoRAConfig(rank=2, alpha=4, target_modules=ALL)
    out_dir = tmp_path / "adapters" if mode == "disk" else None
    async with stub_engine_in_process(**LORA_STUB) as (engine, url):
        async with EngineClient(url) as earlier:  # an earlier trainer's adapter, still loaded
            await earlier.load_lora_adapter_from_tensors(
                adapter_name(7),
                {"r": 2, "lora_alpha": 4, "target_modules": ALL, "peft_type": "LORA"},
                adapter_payload(_peft(ALL)),
            )
        trainer_side, rollout = EngineClient(url), EngineClient(url)
        assert await trainer_side.serves_adapters_by_name()
        sync = NamedAdapterSync(trainer_side, "/unused", lora, out_dir)
        stats = await sync.push(_peft(ALL, seed=1), 1)
        assert list(engine.lora.loaded) == ["agentrl-v1"] and engine.lora.unloaded == ["agentrl-v7"]
        assert engine.weight_version == "1" and trainer_side.adapters == {url: "agentrl-v1"}
        assert stats["num_tensors"] == 2 * 7 * 2 and stats["num_bytes"] > 0
        assert (await rollout.generate([1, 2], SP)).weight_version == "1"

        await sync.push(_peft(ALL, seed=2), 2)
        assert list(engine.lora.loaded) == ["agentrl-v2"] and engine.lora.unloaded[-1] == "agentrl-v1"
        await rollout.continue_generation()  # an update's pause ends: the rollout asks again
        await rollout.generate([1, 2], SP)
        await sync.push(_peft(ALL, seed=3), 2)  # the same version once more (a resume): replaced, not refused
        assert list(engine.lora.loaded) == ["agentrl-v2"] and engine.lora.unloaded[-1] == "agentrl-v2"
        if out_dir is not None:
            assert sorted(p.name for p in out_dir.iterdir()) == ["agentrl-v2"]  # the old dirs went first
        assert engine.lora.log == ["agentrl-v1", "agentrl-v2"] and engine.lora.refused == []
        assert engine.lora.loaded["agentrl-v2"].applied == set(FUSED)
        await trainer_side.close()
        await rollout.close()


def _safe_load_from_bytes(b: bytes) -> Any:  # what megatron-core 0.19 puts in torch.storage at import
    return torch.load(io.BytesIO(b), weights_only=True)


def test_payload_names_only_torch_when_torch_storage_is_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core 0.19 replaces ``torch.storage._load_from_bytes`` with a function of its own module at
    import; a plain pickle of CPU tensors then names that module, and SGLang's restricted unpickler refuses
    the adapter. The payload names torch's function, unpickles under the stand-in's (SGLang's) rules, and
    the patch is in place again afterwards."""
    monkeypatch.setattr(torch.storage, "_load_from_bytes", _safe_load_from_bytes)
    peft = _peft(["q_proj", "v_proj"])
    with pytest.raises(pickle.UnpicklingError, match="test_sglang_lora"):  # the plain pickle, refused
        plain = base64.b64encode(pickle.dumps(peft)).decode()
        _TensorUnpickler(io.BytesIO(base64.b64decode(plain))).load()
    loaded = _TensorUnpickler(io.BytesIO(base64.b64decode(adapter_payload(peft)))).load()
    assert loaded.keys() == peft.keys() and all(torch.equal(loaded[k], peft[k]) for k in peft)
    assert torch.storage._load_from_bytes is _safe_load_from_bytes


def test_partial_targets_are_completed_as_the_trainer_computes_them(tiny_model_dir: Path) -> None:
    """q/k/v and gate/up share one A in the trainer, the B rows of non-targets masked to zero: the missing
    modules go with that A and a zero B (shapes from the model's config), so SGLang can stack them."""
    lora = LoRAConfig(rank=2, alpha=4, target_modules=["k_proj", "up_proj", "down_proj"])
    peft = _peft(["k_proj", "up_proj", "down_proj"])
    full, config = complete_fused_groups(peft, lora, tiny_model_dir)
    assert sorted(config.target_modules) == sorted(
        ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    )
    stem = f"{PEFT_PREFIX}model.layers.1"
    assert torch.equal(
        full[f"{stem}.self_attn.q_proj.lora_A.weight"], peft[f"{stem}.self_attn.k_proj.lora_A.weight"]
    )
    assert full[f"{stem}.self_attn.q_proj.lora_B.weight"].shape == (64, 2)  # 4 heads of 16
    assert full[f"{stem}.self_attn.v_proj.lora_B.weight"].shape == (32, 2)  # 2 KV heads of 16
    assert full[f"{stem}.mlp.gate_proj.lora_B.weight"].count_nonzero() == 0
    assert complete_fused_groups(full, config, tiny_model_dir)[0] is full  # complete already


# ---------------------------------------------------------------------------------------- the client
async def test_client_follows_the_adapter_and_resends_a_refused_request() -> None:
    lora = LoRAConfig(rank=2, alpha=4, target_modules=ALL)
    async with stub_engine_in_process(**LORA_STUB) as (engine, url):
        async with EngineClient(url) as trainer_side, EngineClient(url) as rollout:
            await rollout.generate([1], SP)  # nothing loaded yet: the base model (version 0 of a LoRA run)
            sync = NamedAdapterSync(trainer_side, "/unused", lora)
            await sync.push(_peft(ALL), 1)
            await rollout.continue_generation()
            await rollout.generate([1], SP)
            # an update the rollout was not told of (no pause, no continue): its next request names the
            # unloaded adapter, SGLang refuses it, and the client sends it again naming the new one
            await sync.push(_peft(ALL, seed=1), 2)
            assert rollout.adapters == {url: "agentrl-v1"}
            await rollout.generate([1], SP)
            assert rollout.adapters == {url: "agentrl-v2"}
        assert engine.lora.log == ["base", "agentrl-v1", "agentrl-v2"]
        assert engine.lora.refused == ["agentrl-v1"]  # the one request sent again
    assert adapter_version("agentrl-v12") == 12 and adapter_version("my-adapter") is None


# ---------------------------------------------------------------------------------------- rollout
async def test_requests_resubmitted_after_an_update_name_the_new_adapter(tiny_model_dir: Path) -> None:
    from test_rollout import cfg, tasks
    from transformers import AutoTokenizer

    from agentrl.rollout import Orchestrator
    from agentrl.testing.envs import SyntheticEnv

    lora = LoRAConfig(rank=2, alpha=4, target_modules=ALL)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    stub = dict(LORA_STUB, min_tokens=40, max_tokens=60, per_token_time=0.004)
    async with stub_engine_in_process(**stub) as (engine, url):
        trainer_side, rollout = EngineClient(url, timeout=10), EngineClient(url, timeout=10)
        sync = NamedAdapterSync(trainer_side, "/unused", lora)
        await sync.push(_peft(ALL), 0)  # version 0's adapter: what the rollout starts under
        orch = Orchestrator(
            cfg(
                group_size=2,
                batch_size=4,
                max_staleness=2,
                max_turns=1,
                sampling=SamplingParams(max_new_tokens=64),
            ),
            rollout,
            tok,
            lambda: SyntheticEnv(turns=1),
            tasks(20),
        )
        await orch.start()
        await asyncio.sleep(0.08)  # mid-generation
        await orch.pause_for_update()
        before = len(engine.lora.log)
        await sync.push(_peft(ALL, seed=1), 1)
        await orch.resume_after_update(1)
        batch = await orch.buffer.get_batch(timeout=30)
        await orch.stop()
        await trainer_side.close()
        await rollout.close()
    assert orch.m.counters["interrupted_requests"] > 0
    assert set(engine.lora.log[:before]) == {"agentrl-v0"}
    assert engine.lora.log[before:] and set(engine.lora.log[before:]) == {"agentrl-v1"}
    assert engine.lora.refused == []  # named right the first time: the client asked again at the continue
    resumed = [
        t for t in batch if {v for v, m in zip(t.policy_versions, t.loss_mask, strict=True) if m} == {0, 1}
    ]
    assert resumed, "an interrupted episode goes on under the new adapter"


# ---------------------------------------------------------------------------------------- the trainer
@pytest.fixture
def trainer(tiny_model_dir: Path):
    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    targets = ["k_proj", "o_proj", "up_proj", "down_proj"]  # q/v and gate: completed for SGLang
    cfg = TrainerConfig(
        model_path=str(tiny_model_dir),
        lr=5e-2,
        micro_batch_size=3,
        lora={"rank": 4, "alpha": 8, "target_modules": targets},
    )
    tr = MegatronTrainer(cfg)
    yield tr
    tr.shutdown()


async def test_trainer_syncs_adapters_by_name(trainer: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The trainer's own sync path (connect_engines -> an SGLang-protocol engine with LoRA on): each mode
    loads the versioned adapter, completed for SGLang's stacking, and what is loaded computes the trainer's
    function (merged, it equals the trainer's merged weights)."""
    from safetensors.torch import load_file

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    async with stub_engine_in_process(**LORA_STUB) as (engine, url), EngineClient(url) as client:
        await trainer.connect_engines(WeightUpdate("tensor"), client)
        for version, mode in ((1, "tensor"), (2, "tensor"), (3, "disk")):
            if mode == "disk":
                assert await trainer.disconnect_engines()
                await trainer.connect_engines(WeightUpdate("disk", out_dir=tmp_path / "adapters"), client)
            trajs = make_trajectories(trainer.arch.vocab_size, seed=version)
            offset_rollout_logprobs(trajs, trainer.compute_logprobs(trajs))
            trainer.train_step(trajs)
            assert await trainer.sync_weights() == version
            assert engine.weight_version == str(version) and client.adapters == {url: adapter_name(version)}
            assert engine.lora.loaded[adapter_name(version)].applied == set(FUSED)
        assert list(engine.lora.loaded) == ["agentrl-v3"]
        assert engine.lora.unloaded == ["agentrl-v1", "agentrl-v2"]
        assert (tmp_path / "adapters" / "agentrl-v3" / "adapter_model.safetensors").is_file()
        await trainer.disconnect_engines()
    peft = trainer.lora_state_dict()
    full, _ = complete_fused_groups(peft, trainer.cfg.lora, tiny_model_dir)
    served = merge_into_hf(base, full, trainer.cfg.lora.alpha / trainer.cfg.lora.rank)
    merged = trainer.hf_state_dict("cpu")
    for name, w in merged.items():
        torch.testing.assert_close(served[name], w, rtol=0, atol=1e-6, msg=name)
