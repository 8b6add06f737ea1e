"""Custom Ray resources that place a run's parts on nodes (``ray.engine_resources``,
``ray.trainer_resources``...): the load-time checks of those fields, the node check on ``ray.nodes()``
(tested without a cluster), and the colocated bundles that hold them. A run on a cluster of two hosts is
tests/test_multi_host.py's.
"""

from __future__ import annotations

import json

import pytest

from agentrl.config import ConfigError
from agentrl.placement import check_resources

# ---- config checks (no Ray) ------------------------------------------------------------------------------


def _run_config(**ray: object):
    from agentrl.run_config import RunConfig

    return RunConfig.model_validate(
        {"model_path": "m", "data": {"path": "d"}, "env": {"name": "search"}, "trainer": {}, "ray": ray}
    )


@pytest.mark.parametrize(
    ("ray", "message"),
    [
        ({"engine_resources": {"GPU": 1}}, "GPU is not a custom resource"),
        ({"trainer_resources": {"trainer_node": 0}}, "trainer_node: 0 is no amount Ray can reserve"),
        ({"engine_resources": {"n": 0.00001}}, "n: 1e-05 is no amount"),
    ],
)
def test_resource_fields_are_checked_at_load(ray: dict, message: str) -> None:
    from agentrl.recipe import load_run_config

    overrides = [f"ray.{k}={json.dumps(v)}" for k, v in ray.items()]
    base = ["model_path=m", "data.path=d", "env.name=search", "recipe=default"]
    with pytest.raises(ConfigError, match=rf"ray\.\w+_resources: .*{message}"):
        load_run_config(None, base + overrides)


def test_engine_resources_need_engines_the_run_starts() -> None:
    from agentrl.run_config import RunConfig

    external = {
        "model_path": "m",
        "data": {"path": "d"},
        "env": {"name": "search"},
        "trainer": {},
        "engine": {"backend": "external", "urls": ["http://127.0.0.1:1"]},
    }
    RunConfig.model_validate({**external, "ray": {"trainer_resources": {"trainer_node": 1}}})
    with pytest.raises(ValueError, match=r"ray\.engine_resources: engine\.backend external starts no engine"):
        RunConfig.model_validate({**external, "ray": {"engine_resources": {"engine_node": 1}}})


def test_node_check_names_the_field() -> None:
    engine_node = {"Alive": True, "Resources": {"CPU": 8.0, "engine_node": 1.0}}
    trainer_nodes = [{"Alive": True, "Resources": {"CPU": 8.0, "trainer_node": 1.0}} for _ in range(2)]
    dead = {"Alive": False, "Resources": {"gpu_box": 4.0}}
    cfg = _run_config(engine_resources={"engine_node": 1}, trainer_resources={"trainer_node": 1})
    check_resources(cfg, [engine_node, *trainer_nodes, dead])  # what the run asks for is there

    cfg = _run_config(engine_resources={"gpu_box": 1})  # only on a dead node
    with pytest.raises(ConfigError, match=r"ray\.engine_resources: no node .* has the resource 'gpu_box'"):
        check_resources(cfg, [engine_node, dead])
    cfg = _run_config(trainer_resources={"trainer_node": 1}).model_copy(update={"trainer_world_size": 3})
    with pytest.raises(ConfigError, match=r"ray.trainer_resources: 3 actors .* 3 in all, .* have 2"):
        check_resources(cfg, [engine_node, *trainer_nodes])
    cfg = _run_config(trainer_resources={"trainer_node": 2})  # 2 in all, but 1 on each node
    with pytest.raises(ConfigError, match=r"ray.trainer_resources: no node .* holds \{'trainer_node': 2.0\}"):
        check_resources(cfg, trainer_nodes)


def test_colocated_bundles_hold_the_custom_resources() -> None:
    """Colocated, engine i and trainer rank i sit on GPU i's bundle, which holds their custom resources
    too (an actor on a bundle gets only what the bundle holds)."""
    import ray

    from agentrl.actor_group import on_bundle
    from agentrl.placement import placement_group

    ray.init(num_cpus=2, num_gpus=2, resources={"gpu_box": 2}, include_dashboard=False, log_to_driver=False)
    try:
        group = placement_group(2, resources={"gpu_box": 1})

        @ray.remote
        def gpu() -> list[int]:
            return [int(g) for g in ray.get_gpu_ids()]

        engine = {"num_gpus": 0.5, "num_cpus": 0, "resources": {"gpu_box": 0.5}}
        rank = {"num_gpus": 0.5, "num_cpus": 1, "resources": {"gpu_box": 0.5}}
        placed = [
            gpu.options(**ask, scheduling_strategy=on_bundle(group, i)).remote()
            for i in range(2)
            for ask in (engine, rank)
        ]
        engine0, rank0, engine1, rank1 = ray.get(placed, timeout=60)
        assert engine0 == rank0 != engine1 == rank1
        ray.util.remove_placement_group(group)
    finally:
        ray.shutdown()
