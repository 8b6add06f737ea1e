"""LoRA weight sync to the embedded engine on CPU (fp32): after a trained step only the adapters travel
(in memory, as a PEFT dir, by broadcast) to two engines at once, one per ``--lora-apply``:

* the merging engine merges them into a kept copy of its base weights, and its greedy generations and
  logprobs equal, bit for bit, those of an engine that loaded the trainer's merged weights from disk; each
  adapter merges from the base, not on top of the last;
* the unmerged engine serves ``x W^T + (x A^T) (s · B)^T`` beside untouched weights: the same greedy
  tokens, logprobs within :data:`UNMERGED_TOL` of the merging engine's (the two orders of the same sums in
  fp32), and the trainer's unmerged forward scores its tokens within 1e-4, as it scores the merging
  engine's;

and unloading gives each the base model back, bit for bit."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from _trainer_helpers import make_trajectories, offset_rollout_logprobs

from agentrl.embedded.launch import start_embedded_server
from agentrl.engine.client import EngineClient, EngineRequestError
from agentrl.engine.types import SamplingParams
from agentrl.types import Trajectory
from agentrl.weight_sync import BroadcastGroup, WeightUpdate

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8], [64, 65, 66, 67, 68, 69, 70]]
# fp32 on a CPU: an unmerged engine's logprobs against a merging one's (measured: a few 1e-7)
UNMERGED_TOL = 1e-5


@pytest.fixture
def trainer(tiny_model_dir: Path):
    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(
        model_path=str(tiny_model_dir), lr=5e-2, micro_batch_size=3, lora={"rank": 4, "alpha": 8}
    )
    tr = MegatronTrainer(cfg)
    yield tr
    tr.shutdown()


async def _greedy(client: EngineClient) -> list[tuple[list[int], list[float]]]:
    out = []
    for p in PROMPTS:
        res = await client.generate(p, SamplingParams(max_new_tokens=8, temperature=0.0))
        out.append((res.output_ids, res.logprobs))
    return out


def _step(trainer, seed: int) -> None:
    trajs = make_trajectories(trainer.arch.vocab_size, seed=seed)
    offset_rollout_logprobs(trajs, trainer.compute_logprobs(trajs))
    trainer.train_step(trajs)


async def _merged_engine_answers(trainer, out_dir: Path) -> list[tuple[list[int], list[float]]]:
    trainer.save_hf(out_dir)
    server = start_embedded_server(out_dir)
    client = EngineClient(server.url)
    try:
        return await _greedy(client)
    finally:
        await client.close()
        server.stop()


def _close(a: list[tuple[list[int], list[float]]], b: list[tuple[list[int], list[float]]]) -> float:
    """The largest logprob gap of two engines' greedy answers, which must hold the same tokens."""
    assert [ids for ids, _ in a] == [ids for ids, _ in b]
    return max(abs(x - y) for (_, u), (_, v) in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def _scored_by_trainer(trainer, answers: list[tuple[list[int], list[float]]]) -> float:
    """The largest gap between the engine's logprobs of its tokens and the trainer's."""
    trajs = []
    for p, (ids, lps) in zip(PROMPTS, answers, strict=True):
        t = Trajectory(task_id="t", group_id="g", prompt_ids=p)
        t.append_model_tokens(ids, lps, 1)
        trajs.append(t)
    gaps = [
        abs(a - b)
        for t, lp in zip(trajs, trainer.compute_logprobs(trajs), strict=True)
        for a, b in zip(lp, t.rollout_logprobs, strict=True)
    ]
    return max(gaps)


async def test_adapter_sync_merged_and_unmerged(trainer, tiny_model_dir: Path, tmp_path: Path) -> None:
    merging = start_embedded_server(tiny_model_dir, extra_args=["--lora-apply", "merged"])
    unmerged = start_embedded_server(tiny_model_dir)  # the default; its buffers made at the first adapter
    both = EngineClient([merging.url, unmerged.url])
    merged_c, unmerged_c = EngineClient(merging.url), EngineClient(unmerged.url)
    clients = (both, merged_c, unmerged_c)
    try:
        base_answers = await _greedy(merged_c)
        assert await _greedy(unmerged_c) == base_answers

        async def check(version: int, out_dir: Path) -> None:
            merged, unmerged = await _greedy(merged_c), await _greedy(unmerged_c)
            assert merged == await _merged_engine_answers(trainer, out_dir)  # bit for bit
            assert _close(unmerged, merged) <= UNMERGED_TOL
            # the trainer's unmerged forward scores either engine's tokens alike, to rounding
            assert _scored_by_trainer(trainer, merged) <= 1e-4
            assert _scored_by_trainer(trainer, unmerged) <= 1e-4
            assert [lp for _, lp in unmerged] != [lp for _, lp in base_answers]  # the adapters changed it
            for c in (merged_c, unmerged_c):
                res = await c.generate(PROMPTS[0], SamplingParams(max_new_tokens=1, temperature=0.0))
                assert res.weight_version == str(version)

        _step(trainer, seed=1)
        await trainer.connect_engines(WeightUpdate("tensor"), both)
        assert await trainer.sync_weights() == 1
        stats = trainer.last_sync_stats
        # the figures a colocated step reads off a tensor push (agentrl.handover)
        assert 0 <= stats["pack_seconds"] <= stats["seconds"] and stats["gather_seconds"] >= 0
        adapters = trainer.lora_state_dict()
        full_bytes = sum(t.numel() * t.element_size() for t in trainer.hf_state_dict().values())
        assert stats["num_bytes"] == sum(t.numel() * t.element_size() for t in adapters.values())
        assert stats["num_bytes"] < full_bytes / 10
        await check(1, tmp_path / "merged_v1")
        assert await trainer.disconnect_engines()

        # a second adapter, from disk: merged from the base weights, not on top of the first
        _step(trainer, seed=2)
        await trainer.connect_engines(WeightUpdate("disk", out_dir=tmp_path / "adapter"), both)
        assert await trainer.sync_weights() == 2
        assert {p.name for p in (tmp_path / "adapter").iterdir()} == {
            "adapter_config.json",
            "adapter_model.safetensors",
        }
        await check(2, tmp_path / "merged_v2")
        assert await trainer.disconnect_engines()

        # a third, broadcast (gloo): one bucket of adapters, B scaled, the same bits again
        _step(trainer, seed=3)
        await trainer.connect_engines(
            WeightUpdate("distributed", group=BroadcastGroup(num_engine_ranks=2)), both
        )
        assert await trainer.sync_weights() == 3
        assert trainer.last_sync_stats["num_buckets"] == 1
        assert trainer.last_sync_stats["num_bytes"] == stats["num_bytes"]
        await check(3, tmp_path / "merged_v3")
        assert await trainer.disconnect_engines()

        # unloading puts the base back; unknown adapters and bad dirs are refused with a message
        with pytest.raises(EngineRequestError, match="no adapter 'other' is loaded"):
            await both._all("POST", "/unload_lora_adapter", {"lora_name": "other"})
        # (a broadcast adapter has no name of its own: the engine calls it "broadcast")
        await both._all("POST", "/unload_lora_adapter", {"lora_name": "broadcast"})
        assert await _greedy(merged_c) == base_answers
        assert await _greedy(unmerged_c) == base_answers
        with pytest.raises(EngineRequestError, match="not a PEFT adapter dir"):
            await both.load_lora_adapter("x", str(tmp_path / "merged_v1"))
    finally:
        await trainer.disconnect_engines()
        for c in clients:
            await c.close()
        merging.stop()
        unmerged.stop()


def test_lora_needs_the_embedded_engine() -> None:
    from agentrl.config import ConfigError
    from agentrl.recipe import load_run_config

    base = ["model_path=/m", "data.path=/d", "env.name=math", "trainer.lora.rank=8"]
    assert load_run_config(None, base).weight_sync == "distributed"  # adapters travel by broadcast too
    with pytest.raises(ConfigError, match=r"trainer\.lora: needs engine\.backend: embedded"):
        load_run_config(
            None, [*base, "engine.backend=external", "engine.urls=[http://x:1]", "weight_sync=disk"]
        )
