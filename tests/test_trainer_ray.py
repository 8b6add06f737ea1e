"""The trainer behind a Ray actor (TP=1, CPU): a train step and a disk weight sync to the embedded engine
go through real Ray processes; the version goes up and the engine reports it."""

from __future__ import annotations

from pathlib import Path

import pytest
from _trainer_helpers import make_trajectories

from agentrl.embedded.server import start_embedded_server
from agentrl.trainer.config import TrainerConfig


def test_trainer_group_on_ray(tiny_model_dir: Path, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")  # ray is a hard dependency of agentrl: a missing one fails at install
    from agentrl.trainer.ray_actor import TrainerGroup

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    server = start_embedded_server(tiny_model_dir)
    group = None
    try:
        group = TrainerGroup(TrainerConfig(model_path=str(tiny_model_dir), lr=1e-3), world_size=1)
        metrics = group.train_step(make_trajectories(600, seed=5))
        assert metrics["loss"] != 0.0 and metrics["num_trajectories"] == 6
        assert group.sync_weights_from_disk([server.url], str(tmp_path / "hf")) == 1
        assert group.policy_version() == 1
        import httpx

        assert httpx.get(server.url + "/get_weight_version").json()["weight_version"] == "1"
    finally:
        if group is not None:
            group.shutdown()
        server.stop()
        ray.shutdown()
