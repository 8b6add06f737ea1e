"""The trainer behind Ray actors (TP=1, CPU): a train step and a disk weight sync to the embedded engine
go through real Ray processes; the version goes up and the engine reports it. The rank runs on the
placement group bundle it was given."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from _trainer_helpers import make_trajectories

from agentrl.embedded.launch import start_embedded_server
from agentrl.trainer.config import TrainerConfig
from agentrl.weight_sync import WeightUpdate


def _bundle_cpus_free(ray, pg, index: int) -> float:
    """The CPUs of bundle ``index`` of placement group ``pg`` that no actor holds."""
    return ray.available_resources().get(f"CPU_group_{index}_{pg.id.hex()}", 0.0)


async def _engine_version(url: str) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(url + "/get_weight_version")).json()["weight_version"]


async def test_trainer_group_on_ray(tiny_model_dir: Path, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")  # ray is a hard dependency of agentrl: a missing one fails at install
    from ray.util.placement_group import placement_group

    from agentrl.trainer.ray_actor import TrainerGroup

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    server = start_embedded_server(tiny_model_dir)
    group = None
    try:
        pg = placement_group([{"CPU": 1}, {"CPU": 1}])
        await pg.ready()
        cfg = TrainerConfig(model_path=str(tiny_model_dir), lr=1e-3)
        group = TrainerGroup(cfg, world_size=1, placement_group=pg, bundle_indices=[1])
        assert (_bundle_cpus_free(ray, pg, 0), _bundle_cpus_free(ray, pg, 1)) == (1.0, 0.0)

        batch = make_trajectories(600, seed=5)
        metrics = await group.train_step(batch, max_staleness=0, record_logprobs=True)
        assert metrics["loss"] != 0.0 and metrics["num_trajectories"] == 6
        recorded = (await group.last_logprobs())["logprobs"]
        assert [len(lp) for lp in recorded] == [len(t.response_ids) for t in batch]

        await group.connect_engines(WeightUpdate("disk", [server.url], out_dir=str(tmp_path / "hf")))
        assert await group.sync_weights() == 1
        assert await group.policy_version() == 1
        assert (await group.last_sync_stats())["gather_seconds"] > 0
        assert await _engine_version(server.url) == "1"
        assert await group.sync_weights() == 2
        assert await _engine_version(server.url) == "2"
        assert await group.disconnect_engines() is True
    finally:
        if group is not None:
            await group.shutdown()
        server.stop()
        ray.shutdown()


async def test_every_rank_hands_weights_in_memory_to_its_own_engine(tiny_model_dir: Path) -> None:
    """Two ranks, two engines, ``tensor``: engine j takes its weights from rank j (colocated on GPUs, the
    rank on its GPU: a CUDA IPC handle opens nowhere else), so both ranks push and both engines move on."""
    ray = pytest.importorskip("ray")
    from agentrl.trainer.ray_actor import TrainerGroup

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    servers = [start_embedded_server(tiny_model_dir) for _ in range(2)]
    group = None
    try:
        group = TrainerGroup(TrainerConfig(model_path=str(tiny_model_dir), lr=1e-3), world_size=2)
        await group.train_step(make_trajectories(600, seed=5), max_staleness=0)
        await group.connect_engines(WeightUpdate("tensor", [s.url for s in servers]))
        assert await group.sync_weights() == 1
        assert [await _engine_version(s.url) for s in servers] == ["1", "1"]
        pushed = ray.get([a.call.remote("last_sync_stats") for a in group.actors])
        assert all(p["num_tensors"] > 0 for p in pushed), pushed  # each rank pushed to its engine
        assert await group.sync_weights() == 2
        assert [await _engine_version(s.url) for s in servers] == ["2", "2"]
    finally:
        if group is not None:
            await group.shutdown()
        for s in servers:
            s.stop()
        ray.shutdown()
