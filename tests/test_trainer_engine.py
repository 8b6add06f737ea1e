"""Trainer <-> embedded engine: with fresh weights the trainer's π_old matches the engine's μ per token
(≤ 1e-4, fp32 CPU) and the first-step PPO-KL is exactly 0; weights then reach the engine by distributed
broadcast (gloo, bucketed) and from disk, the version going up by one per sync, and the engine's
logprobs follow the trainer's new weights. For a dense model and a mixture-of-experts model (its experts
sent under the checkpoint's per-expert names; the trainer replays the engine's routing)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from agentrl.embedded.launch import start_embedded_server
from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.types import Trajectory
from agentrl.weight_sync import BroadcastGroup, WeightUpdate


@pytest.fixture(params=["qwen2", "qwen3_moe"])
def model_dir(request, tiny_model_factory) -> Path:
    return tiny_model_factory(request.param)


@pytest.fixture
def trainer(model_dir: Path):
    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    moe = {"routing_replay": True} if "moe" in model_dir.name else {}
    cfg = TrainerConfig(
        model_path=str(model_dir), lr=1e-2, micro_batch_size=3, weight_sync_bucket_mb=1, moe=moe
    )
    tr = MegatronTrainer(cfg)
    yield tr
    tr.shutdown()


async def _rollouts(client: EngineClient, n: int, version: int, seed: int) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 600, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        t = Trajectory(task_id=f"t{i}", group_id=f"g{i // 2}", prompt_ids=prompt)
        res = await client.generate(
            prompt,
            SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=seed + i),
            return_routed_experts=True,
        )
        t.append_model_tokens(res.output_ids, res.logprobs, version)
        t.append_observation_tokens([5, 6, 7])
        res2 = await client.generate(
            t.input_ids,
            SamplingParams(max_new_tokens=5, temperature=1.0, sampling_seed=seed + 100 + i),
            return_routed_experts=True,
        )
        t.append_model_tokens(res2.output_ids, res2.logprobs, version)
        t.routed_experts = res2.meta.get("routed_experts")  # MoE only: every input position's experts
        t.reward = float(i % 2)
        t.info["weight_version"] = res2.weight_version
        out.append(t)
    return out


def _max_abs_diff(trainer, trajs: list[Trajectory]) -> float:
    worst = 0.0
    for t, lp in zip(trajs, trainer.compute_logprobs(trajs), strict=True):
        for a, b, m in zip(lp, t.rollout_logprobs, t.loss_mask, strict=True):
            if m:
                worst = max(worst, abs(a - b))
    return worst


async def test_trainer_engine_consistency_and_weight_sync(trainer, model_dir: Path, tmp_path: Path) -> None:
    server = start_embedded_server(model_dir)
    client = EngineClient(server.url)
    try:
        trajs = await _rollouts(client, 6, version=0, seed=1)
        assert sum(t.num_model_tokens for t in trajs) > 20
        assert all((t.routed_experts is not None) == (trainer.arch.moe is not None) for t in trajs)
        assert _max_abs_diff(trainer, trajs) <= 1e-4

        metrics = trainer.train_step(trajs)
        assert metrics["ppo_kl"] == 0.0  # exactly: the update's first forward equals the π_old recompute
        assert metrics["mismatch_logprob_abs_diff_max"] <= 1e-4
        assert metrics["mismatch_kl"] <= 1e-8

        # distributed broadcast (gloo); small buckets -> several update_weights_from_distributed calls
        await trainer.connect_engines(
            WeightUpdate("distributed", group=BroadcastGroup(bucket_bytes=64 << 10)), client
        )
        assert await trainer.sync_weights() == 1
        assert trainer.last_sync_stats["num_buckets"] > 1
        fresh = await _rollouts(client, 4, version=1, seed=7)
        assert {t.info["weight_version"] for t in fresh} == {"1"}
        assert _max_abs_diff(trainer, fresh) <= 1e-4
        # ... and the weights really moved: the original checkpoint scores these tokens differently
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        t = fresh[0]
        with torch.no_grad():
            logits = base(torch.tensor([t.input_ids])).logits[0, len(t.prompt_ids) - 1 : -1]
        base_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.response_ids)[:, None]).squeeze(-1)
        assert (base_lp - torch.tensor(t.rollout_logprobs)).abs()[torch.tensor(t.loss_mask) == 1].max() > 1e-3

        # one way to the engines at a time; both ends leave the group together (cleanly, no abort)
        with pytest.raises(RuntimeError, match="already connected"):
            await trainer.connect_engines(WeightUpdate("disk", out_dir=tmp_path / "hf_v2"), client)
        assert await trainer.disconnect_engines(timeout=30) is True

        # from disk
        trainer.train_step(fresh)
        await trainer.connect_engines(WeightUpdate("disk", out_dir=tmp_path / "hf_v2"), client)
        assert await trainer.sync_weights() == 2
        assert (tmp_path / "hf_v2" / "model.safetensors").is_file()
        again = await _rollouts(client, 4, version=2, seed=11)
        assert {t.info["weight_version"] for t in again} == {"2"}
        assert _max_abs_diff(trainer, again) <= 1e-4
        assert trainer.train_step(again)["ppo_kl"] == 0.0
        assert await trainer.disconnect_engines() is True

        # the engine can join a new broadcast group after leaving the first; this one sends each bucket
        # as one broadcast of its bytes (SGLang's flattened_bucket), and the engine serves those weights
        flat = BroadcastGroup(bucket_bytes=64 << 10, flatten=True)
        await trainer.connect_engines(WeightUpdate("distributed", group=flat), client)
        assert await trainer.sync_weights() == 3
        stats = trainer.last_sync_stats
        assert stats["num_buckets"] > 1 and stats["num_broadcasts"] == stats["num_buckets"]
        last = await _rollouts(client, 4, version=3, seed=13)
        assert {t.info["weight_version"] for t in last} == {"3"}
        assert _max_abs_diff(trainer, last) <= 1e-4
    finally:
        await trainer.disconnect_engines()
        await client.close()
        server.stop()
