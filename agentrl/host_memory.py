"""What a run keeps in host memory, and the check that it fits before anything starts.

Three parts of a GPU run live in host memory by design:

* **CPU Adam** (``trainer.optimizer_cpu_offload``): megatron's hybrid optimizer keeps, for every
  parameter, an fp32 copy, an fp32 gradient and Adam's two fp32 moments on the host: 16 bytes a
  parameter, each parameter once over the ranks (the distributed optimizer shards them);
* **the trainer's offload** (``colocation.trainer_offload``, colocated turns): each rank's weights
  (bf16: 2 bytes a parameter it holds, the replicated ones on every rank) and, without CPU Adam, its
  shard of the fp32 main weights and moments (12 bytes a parameter over the ranks); gradients are freed,
  not kept;
* **the engines' weights** while they sleep: the embedded engine on a GPU saves them to pinned host memory
  when it releases them (``colocation.engine_release: all``), SGLang with
  ``engine.sglang.weights_cpu_backup``; 2 bytes a parameter an engine.

:func:`host_bytes` adds them up for the model of a run (its HF ``config.json``); :func:`check_host_memory`
refuses a run whose trainer ranks all start on this host (no ``ray.address``) when they alone exceed its
memory, naming the fields, before a model loads. Processes, Ray and the page cache need more on top: the
check refuses only what cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.config import ConfigError

if TYPE_CHECKING:
    from agentrl.run_config import RunConfig

GB = 1e9
CPU_ADAM_BYTES = 16  # fp32 main weight, fp32 gradient, two fp32 Adam moments
OPTIMIZER_BYTES = 12  # fp32 main weight and two moments, offloaded from the GPU
WEIGHT_BYTES = 2  # bf16


@dataclass(frozen=True)
class HostMemory:
    """A run's host memory by part, in bytes."""

    cpu_adam: float = 0.0
    trainer_offload: float = 0.0
    engine_weights: float = 0.0

    @property
    def total(self) -> float:
        return self.cpu_adam + self.trainer_offload + self.engine_weights

    def parts(self) -> str:
        named = {
            "trainer.optimizer_cpu_offload": self.cpu_adam,
            "colocation.trainer_offload": self.trainer_offload,
            "the engines' weights while they sleep": self.engine_weights,
        }
        return ", ".join(f"{name} {b / GB:.0f} GB" for name, b in named.items() if b > 0)


def host_bytes(cfg: RunConfig, model_dir: str | Path) -> HostMemory:
    """The run's host memory by part for the model in ``model_dir`` (zero where a part is off or the
    trainer is not on GPUs)."""
    from agentrl.run_checks import engine_on_gpu, trainer_on_gpu

    if not trainer_on_gpu(cfg):
        return HostMemory()
    from agentrl.trainer.arch import ModelArch

    arch = ModelArch.from_hf_dir(model_dir)
    total = arch.num_params()
    experts = arch.num_layers * arch.moe.total_ffn_params(arch.hidden_size) if arch.moe else 0
    t, world = cfg.trainer, cfg.trainer_world_size
    split = t.tp * t.pp  # the GPUs one copy of the dense weights is split over
    held = (total - experts) * (world // split) + experts * max(world // (split * t.ep), 1)
    cpu_adam = CPU_ADAM_BYTES * total if t.optimizer_cpu_offload else 0.0
    turns = cfg.placement == "colocated" and cfg.colocation.mode == "turns"
    offload = 0.0
    if turns and cfg.colocation.trainer_offload != "none":
        offload = WEIGHT_BYTES * held + (0 if t.optimizer_cpu_offload else OPTIMIZER_BYTES * total)
    e = cfg.engine
    if e.backend == "embedded":  # saves its weights on a release of everything
        backup = engine_on_gpu(cfg) and turns and cfg.colocation.engine_release == "all"
    else:
        backup = e.backend == "sglang" and e.sglang is not None and e.sglang.weights_cpu_backup
    engines = WEIGHT_BYTES * total * e.num_engines if backup else 0.0
    return HostMemory(float(cpu_adam), float(offload), float(engines))


def memory_total() -> float | None:
    """This host's memory in bytes (``MemTotal`` of /proc/meminfo); None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(cfg: RunConfig, model_dir: str | Path, host: float | None = None) -> None:
    """Raise ConfigError when the run's host memory (:func:`host_bytes`) exceeds ``host`` bytes (default:
    this host's), for a run that starts its own Ray on this host; nothing for a cluster's run (its ranks'
    hosts are Ray's choice) or a model dir without an HF config."""
    if cfg.ray.address is not None or not (Path(model_dir) / "config.json").is_file():
        return
    host = memory_total() if host is None else host
    need = host_bytes(cfg, model_dir)
    if host is None or need.total <= host:
        return
    raise ConfigError(
        f"trainer.optimizer_cpu_offload / colocation.trainer_offload: the run keeps about "
        f"{need.total / GB:.0f} GB in host memory ({need.parts()}) for {model_dir}, and this host has "
        f"{host / GB:.0f} GB; train fewer parameters (scale.num_layers for a random shape), keep the "
        "trainer's state on its GPUs (colocation.trainer_offload: none), or spread the ranks over hosts"
    )


__all__ = ["HostMemory", "check_host_memory", "host_bytes", "memory_total"]
