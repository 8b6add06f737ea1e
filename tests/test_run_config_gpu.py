"""GPU placement in the run config: each engine and trainer rank on cuda reserves a GPU share in Ray (an
actor that reserves none sees no GPU), colocated runs halve a GPU and cannot broadcast over NCCL, and a
run that asks for more GPUs than Ray has fails at start with the fields named instead of waiting."""

from __future__ import annotations

import importlib.util
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
        (["engine.gpus_per_engine=0"], "engine.gpus_per_engine: an embedded engine on cuda"),
        (["trainer_gpus_per_rank=0"], "trainer_gpus_per_rank: a trainer on cuda"),
        (["colocation.overlap=true"], "colocation.overlap: the engines generate while the trainer steps"),
    ],
)
def test_bad_gpu_placement_names_the_field(overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_run_config(GPU_CONFIG, overrides)


def test_overlap_shares_the_gpu_without_sleep_or_offload() -> None:
    off = ["colocation.engine_sleep=false", "colocation.trainer_offload=false"]
    cfg = load_run_config(GPU_CONFIG, [*off, "colocation.overlap=true"])
    assert cfg.colocation.overlap and cfg.gpus_needed() == 1.0
    cfg = load_run_config(GPU_CONFIG, ["placement=disaggregated", "weight_sync=distributed", "colocation.overlap=true"])
    assert not cfg.colocation.overlap  # nothing to share: the switch does not apply


def test_too_few_gpus_fails_at_start_instead_of_waiting() -> None:
    import ray

    spec = importlib.util.spec_from_file_location(
        "train_async_main", GPU_CONFIG.parents[2] / "train_async.py"
    )
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    cfg = load_run_config(GPU_CONFIG, ["placement=disaggregated", "weight_sync=distributed"])
    ray.init(num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(ConfigError, match=r"reserves 2 GPUs .* but Ray has 1"):
            mod.check_gpus(cfg)
        mod.check_gpus(load_run_config(GPU_CONFIG, []))  # colocated: one GPU is enough
    finally:
        ray.shutdown()
