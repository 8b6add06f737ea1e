"""Placement on Ray's fake GPUs (CPU only): a colocated run's placement group pairs engine i and trainer
rank i on GPU i, and a group Ray cannot place fails with the field to change instead of waiting; the
engines a run starts get the run's switches."""

from __future__ import annotations

import pytest

from agentrl.actor_group import on_bundle
from agentrl.config import ConfigError
from agentrl.placement import placement_group


@pytest.fixture
def two_fake_gpus():
    import ray

    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_engine_i_and_trainer_rank_i_share_gpu_i(two_fake_gpus) -> None:
    ray = two_fake_gpus

    class Who:  # defined here: Ray ships it by value (a test module is not importable in its workers)
        def gpus(self) -> list[int]:
            import ray

            return [int(g) for g in ray.get_gpu_ids()]

    group = placement_group(2)
    who = ray.remote(Who)
    # an engine as agentrl.placement.Fleet starts it (no CPU of its own), a trainer rank as TrainerGroup does
    engines = [
        who.options(num_gpus=0.5, num_cpus=0, scheduling_strategy=on_bundle(group, i)).remote()
        for i in range(2)
    ]
    ranks = [
        who.options(num_gpus=0.5, num_cpus=1, scheduling_strategy=on_bundle(group, i)).remote()
        for i in range(2)
    ]
    engine_gpus = ray.get([a.gpus.remote() for a in engines])
    rank_gpus = ray.get([a.gpus.remote() for a in ranks])
    assert engine_gpus == rank_gpus  # pair i on one GPU
    assert sorted(g for gs in engine_gpus for g in gs) == [0, 1]  # and the pairs on different GPUs
    assert on_bundle(None, 0) is None


def test_a_group_ray_cannot_place_names_the_field(two_fake_gpus, monkeypatch) -> None:
    import agentrl.placement as placement

    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(ConfigError, match=r"could not place 3 bundles .* \(trainer_world_size = 3\)"):
        placement_group(3)


def test_engine_quantization_reaches_the_engines_it_starts() -> None:
    """``engine.quantization`` is the one switch: the embedded engine gets ``--quantization``, an SGLang
    server's config its ``quantization``."""
    from agentrl.placement import engine_starter
    from agentrl.recipe import load_run_config

    run = ["model_path=/m", "data.path=/d", "env.name=math", "engine.quantization=fp8"]
    embedded = engine_starter(load_run_config(None, run), "/m", 0)
    assert embedded.keywords["extra_args"][-2:] == ["--quantization", "fp8"]
    plain = engine_starter(load_run_config(None, run[:-1]), "/m", 0)
    assert "--quantization" not in plain.keywords["extra_args"]
    sglang = engine_starter(load_run_config(None, [*run, "engine.backend=sglang"]), "/m", 0)
    assert sglang.args[0].quantization == "fp8"


def test_routing_replay_asks_sglang_servers_for_their_routing() -> None:
    """``trainer.moe.routing_replay`` needs the experts the engine routed each token to: the SGLang servers a
    run starts get ``--enable-return-routed-experts`` (without it they answer without the record)."""
    from agentrl.engine.launcher import SGLangLauncher
    from agentrl.placement import engine_starter
    from agentrl.recipe import load_run_config

    run = ["model_path=/m", "data.path=/d", "env.name=math", "engine.backend=sglang"]
    replay = load_run_config(None, [*run, "trainer.moe.routing_replay=true"])
    assert replay.rollout.return_routed_experts
    served = engine_starter(replay, "/m", 0).args[0]
    assert "--enable-return-routed-experts" in SGLangLauncher(served).command()
    plain = engine_starter(load_run_config(None, run), "/m", 0).args[0]
    assert "--enable-return-routed-experts" not in SGLangLauncher(plain).command()


def test_trainer_ranks_start_with_the_nccl_setting_of_sglang_servers() -> None:
    """A weight-update group between trainer ranks and SGLang servers opens only when both ends run NCCL
    with the same NCCL_CUMEM_ENABLE, which SGLang's schedulers set to 0: with SGLang engines the ranks start
    with it; with the embedded engine nothing is set."""
    from agentrl.recipe import load_run_config
    from agentrl.weight_sync import trainer_env

    run = ["model_path=/m", "data.path=/d", "env.name=math"]
    sglang = load_run_config(None, [*run, "engine.backend=sglang"]).engine.backend
    assert trainer_env(sglang) == {"NCCL_CUMEM_ENABLE": "0"}
    assert trainer_env(load_run_config(None, run).engine.backend) == {}


def test_a_child_process_is_given_the_machine_gpu_behind_this_process_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agentrl.testing.gpus import child_gpu_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert child_gpu_env(0) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert child_gpu_env(1) == {"CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=2,3 gives 2"):
        child_gpu_env(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert child_gpu_env(1) == {"CUDA_VISIBLE_DEVICES": "1"}
