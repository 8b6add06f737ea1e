"""GPU placement in the run config: each engine and trainer rank on cuda reserves a GPU share in Ray (an
actor that reserves none sees no GPU), colocated runs halve a GPU and cannot broadcast over NCCL, and a
run that asks for more GPUs than Ray has fails at start with the fields named instead of waiting."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.config import ConfigError
from agentrl.recipe import load_run_config

GPU_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "search_r1" / "config_gpu.yaml"


def test_colocated_gpu_config_halves_one_gpu() -> None:
    cfg = load_run_config(GPU_CONFIG, [])
    assert (cfg.engine.gpus_per_engine, cfg.trainer_gpus_per_rank, cfg.gpus_needed()) == (0.5, 0.5, 1.0)


def test_disaggregated_takes_a_gpu_each() -> None:
    cfg = load_run_config(GPU_CONFIG, ["placement=disaggregated", "weight_sync=distributed"])
    assert (cfg.engine.gpus_per_engine, cfg.trainer_gpus_per_rank, cfg.gpus_needed()) == (1.0, 1.0, 2.0)


def test_cpu_defaults_reserve_no_gpu() -> None:
    cfg = load_run_config(None, ["model_path=/m", "data.path=/d", "env.name=math"])
    assert cfg.gpus_needed() == 0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["weight_sync=distributed"], "weight_sync: NCCL cannot broadcast"),
        (["engine.gpus_per_engine=0"], "engine.gpus_per_engine: an engine on a GPU"),
        (["trainer_gpus_per_rank=0"], "trainer_gpus_per_rank: a trainer on cuda"),
        (["colocation.overlap=true"], "overlap was replaced: colocation.mode: overlap"),
        (["colocation.engine_sleep=true"], "engine_sleep was replaced: colocation.engine_release"),
        (["colocation.trainer_offload=true"], "trainer_offload is no longer a switch"),
        (
            ["colocation.mode=overlap", "colocation.engine_release=all"],
            "colocation.mode overlap: the engines",
        ),
        (["rollout.deterministic=true"], "deterministic was replaced: the run.s top-level"),
        (
            ["trainer.pack_sequences=true", "trainer.max_tokens_per_micro_batch=null"],
            "trainer.pack_sequences: needs",
        ),
        (["trainer.tp=2"], "trainer_world_size: 1 ranks are not a multiple of trainer tp \\* pp = 2"),
        (["trainer_world_size=2"], "engine.num_engines: colocated, engine i and trainer rank i share GPU i"),
        (
            ["engine.backend=sglang", "trainer.true_on_policy=true"],
            "trainer.true_on_policy: needs engine.backend",
        ),
        (
            ["deterministic=true", "trainer.tp=2", "trainer_world_size=2", "engine.num_engines=2"],
            "deterministic: the exact forward needs trainer.tp = 1",
        ),
    ],
)
def test_bad_gpu_placement_names_the_field(overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_run_config(GPU_CONFIG, overrides)


def test_overlap_is_one_override_and_turns_release_by_default() -> None:
    cfg = load_run_config(GPU_CONFIG, [])
    assert (cfg.colocation.mode, cfg.colocation.engine_release, cfg.colocation.trainer_offload) == (
        "turns",
        "all",
        "ahead",
    )
    cfg = load_run_config(GPU_CONFIG, ["colocation.mode=overlap"])
    assert (cfg.colocation.engine_release, cfg.colocation.trainer_offload) == ("none", "none")
    assert cfg.gpus_needed() == 1.0
    cfg = load_run_config(
        GPU_CONFIG, ["colocation.engine_release=kv_cache", "colocation.trainer_offload=after_batch"]
    )
    assert (cfg.colocation.engine_release, cfg.colocation.trainer_offload) == ("kv_cache", "after_batch")


def test_colocated_on_two_gpus_pairs_two_engines_with_two_ranks() -> None:
    from agentrl.placement import colocated_bundles

    cfg = load_run_config(GPU_CONFIG, ["trainer_world_size=2", "engine.num_engines=2"])
    assert (cfg.gpus_needed(), colocated_bundles(cfg)) == (2.0, 2)
    assert (
        colocated_bundles(load_run_config(GPU_CONFIG, ["placement=disaggregated", "weight_sync=distributed"]))
        == 0
    )


def test_tp_must_divide_the_models_heads_before_anything_starts(tmp_path) -> None:
    import json

    from agentrl.run_checks import check_model_shape

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3}))
    two = load_run_config(GPU_CONFIG, ["trainer.tp=2", "trainer_world_size=2", "engine.num_engines=2"])
    with pytest.raises(
        ConfigError, match=r"trainer.tp: 2 does not divide the model's 9 attention heads and 3 KV"
    ):
        check_model_shape(two, str(tmp_path))
    three = load_run_config(GPU_CONFIG, ["trainer.tp=3", "trainer_world_size=3", "engine.num_engines=3"])
    check_model_shape(three, str(tmp_path))  # 9 and 3 heads split three ways


def test_too_few_gpus_or_cpus_fail_at_start_instead_of_waiting() -> None:
    import ray

    from agentrl.placement import check_cluster

    cfg = load_run_config(GPU_CONFIG, ["placement=disaggregated", "weight_sync=distributed"])
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(ConfigError, match=r"reserves 2 GPUs .* but Ray has 1"):
            check_cluster(cfg)
        check_cluster(load_run_config(GPU_CONFIG, []))  # colocated: one GPU is enough
        # a trainer rank and the rollout reserve a CPU each: two ranks and the rollout do not fit in 2
        cpu = load_run_config(
            None, ["model_path=/m", "data.path=/d", "env.name=math", "trainer_world_size=2"]
        )
        with pytest.raises(
            ConfigError, match=r"trainer_world_size: .* reserves 3 CPUs .* set ray.num_cpus=3"
        ):
            check_cluster(cpu)
    finally:
        ray.shutdown()
