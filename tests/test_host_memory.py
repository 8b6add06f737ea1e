"""The host memory a run keeps by design (agentrl.host_memory): CPU Adam's state, the trainer's offload and
the engines' saved weights, added up from the model's config and refused before anything starts when they
alone exceed the host."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.config import ConfigError
from agentrl.host_memory import check_host_memory, host_bytes
from agentrl.models.tiny import shape_config
from agentrl.recipe import load_run_config
from agentrl.trainer.arch import ModelArch

ROOT = Path(__file__).resolve().parents[1]
SCALE = ROOT / "examples" / "scale"
GIB = 2**30


def _shape_dir(tmp_path: Path, shape: str, num_layers: int | None = None) -> Path:
    """An HF dir with only the config of ``shape`` (what the check reads; no weights)."""
    d = tmp_path / f"{shape}-{num_layers}"
    d.mkdir()
    (d / "config.json").write_text(shape_config(shape, num_layers).to_json_string())
    return d


def test_the_whole_30b_a3b_does_not_fit_a_512_gib_host_with_cpu_adam(tmp_path: Path) -> None:
    """EP4 on four GPUs: CPU Adam's 16 bytes a parameter, and each rank's bf16 weights while the engine
    generates (the dense part on all four ranks, a quarter of the experts each)."""
    cfg = load_run_config(SCALE / "config_30b_a3b.yaml")
    model = _shape_dir(tmp_path, "qwen3-30b-a3b")
    arch = ModelArch.from_hf_dir(model)
    total = arch.num_params()
    experts = arch.num_layers * arch.moe.total_ffn_params(arch.hidden_size)
    need = host_bytes(cfg, model)
    assert need.cpu_adam == 16 * total
    assert need.trainer_offload == 2 * ((total - experts) * 4 + experts)
    assert need.engine_weights == 0  # SGLang drops released weights: the sync rewrites them
    assert 550e9 < need.total < 570e9
    with pytest.raises(ConfigError, match=r"trainer.optimizer_cpu_offload .* about 5\d\d GB .* has 550 GB"):
        check_host_memory(cfg, model, host=512 * GIB)


def test_the_measured_moe_layout_fits_its_host_and_a_cluster_run_is_not_judged(tmp_path: Path) -> None:
    """12 of 30B-A3B's layers on 2 GPUs with CPU Adam ran on a 256 GB host; a run on a Ray cluster places
    its ranks on hosts of Ray's choice, so this host's memory says nothing about it."""
    cfg = load_run_config(SCALE / "config_moe_2gpu.yaml")
    model = _shape_dir(tmp_path, "qwen3-30b-a3b", 12)
    assert 100e9 < host_bytes(cfg, model).total < 0.7 * 256e9
    check_host_memory(cfg, model, host=256e9)
    whole = _shape_dir(tmp_path, "qwen3-30b-a3b")
    cluster = load_run_config(SCALE / "config_30b_a3b.yaml", ["ray.address=auto"])
    check_host_memory(cluster, whole, host=64e9)


def test_offload_without_cpu_adam_and_engine_backups_count(tmp_path: Path) -> None:
    """Colocated TP2 x DP2 at 7B: the offload moves each rank's bf16 weights and the fp32 main weights and
    moments; embedded engines on GPUs that release everything save their weights to the host as well."""
    model = _shape_dir(tmp_path, "qwen2.5-7b")
    total = ModelArch.from_hf_dir(model).num_params()
    cfg = load_run_config(SCALE / "config_7b.yaml")
    need = host_bytes(cfg, model)
    assert (need.cpu_adam, need.engine_weights) == (0, 0)
    assert need.trainer_offload == 2 * total * 2 + 12 * total  # two copies of the weights (DP2), one state
    embedded = load_run_config(
        SCALE / "config_7b.yaml", ["engine.backend=embedded", "engine.device=cuda", "engine.dtype=bfloat16"]
    )
    assert host_bytes(embedded, model).engine_weights == 2 * total * 4  # four engines
    kept = load_run_config(SCALE / "config_7b.yaml", ["colocation.trainer_offload=none"])
    assert host_bytes(kept, model).total == 0


def test_a_cpu_run_keeps_nothing_there_by_design(tmp_path: Path) -> None:
    cfg = load_run_config(SCALE / "config.yaml")
    assert host_bytes(cfg, _shape_dir(tmp_path, "qwen2.5-7b")).total == 0
