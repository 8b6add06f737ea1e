"""RunConfig: the one validated config of a ``train_async.py`` run, composed of the components' configs.

Loaded from one YAML file plus ``key=value`` overrides (``rollout.group_size=4 trainer.lr=1e-4``) by
:func:`agentrl.recipe.load_run_config`; any unknown or invalid field fails with its dotted path. This is
the generic part, the same for every env and verifier. A run's ``recipe`` (:mod:`agentrl.recipe`) may
validate it with a subclass that adds its own sections, as the Search-R1 demo adds ``bootstrap`` and
``retrieval``. ``trainer.model_path`` defaults to the run's ``model_path``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from agentrl.config import ConfigModel
from agentrl.engine.launcher import SGLangConfig
from agentrl.metrics import MetricsConfig
from agentrl.rollout.config import RolloutConfig
from agentrl.trainer.config import TrainerConfig


class DataConfig(ConfigModel):
    """Where tasks come from: one task dict per JSONL line or parquet row (what ``env.reset`` receives;
    its ``label`` goes to the verifier), read by the run's recipe."""

    path: str = Field(
        description="a directory holding <split>.jsonl (or .jsonl.gz, .parquet) per split, or one such file "
        "of training tasks (then there are no held-out tasks)"
    )
    train_split: str = Field("train", description="split name of the training tasks")
    test_split: str = Field("test", description="split name of the held-out tasks")
    max_train_tasks: int | None = Field(None, ge=1, description="use at most this many training tasks")


class EnvConfig(ConfigModel):
    """Which registered env every episode gets, and its constructor arguments."""

    name: str = Field(description="registered env name or module:Class (agentrl.envs.make_env)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="constructor arguments of the env")


class EngineSetupConfig(ConfigModel):
    """Inference engines: the embedded engine (CPU or one GPU each) or SGLang servers."""

    backend: Literal["embedded", "sglang", "external"] = Field(
        "embedded",
        description="embedded: agentrl.embedded.server; sglang: launch SGLang; external: use urls",
    )
    num_engines: int = Field(
        1, ge=1, description="engine servers to start (each behind least-loaded routing)"
    )
    device: str = Field("cpu", description="embedded engine device: cpu or cuda")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="embedded engine dtype")
    max_batch_size: int = Field(64, ge=1, description="embedded engine: sequences decoded together at most")
    gpus_per_engine: float | None = Field(
        None,
        ge=0,
        description="GPUs Ray reserves per engine actor (None: an embedded engine on cuda 1, or 0.5 when "
        "colocated; else 0, so set it for sglang)",
    )
    mem_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="embedded engine on GPU: share of the memory free after loading the model that its KV "
        "cache may take (None: transformers' default; colocated runs need room for the trainer)",
    )
    urls: list[str] = Field(default_factory=list, description="external: engine or sglang-router URLs")
    router: bool = Field(
        False,
        description="external: urls are sglang-routers; the rollout generates through them, while control "
        "calls and the trainer's weight sync go to the workers they list (GET /workers) at start",
    )
    api_key: str | None = Field(None, description="API key of the engines (admin endpoints check it)")
    sglang: SGLangConfig | None = Field(
        None, description="backend sglang: the launch settings (model_path filled in)"
    )


class ColocationConfig(ConfigModel):
    """``placement: colocated``: what gives up its GPU memory while the other side works (slime's
    ``--offload``). Both off: engine and trainer keep everything on the GPU all the time. Ignored (both
    off) with ``placement: disaggregated``."""

    engine_sleep: bool = Field(
        False,
        description="the engines release their KV cache and weights (SGLang's /release_memory_occupation) "
        "while the trainer steps, and take them back for the weight sync and the next generation; lets "
        "engine.mem_fraction go to 0.7+. SGLang engines get --enable-memory-saver",
    )
    engine_keep_weights: bool = Field(
        False,
        description="with engine_sleep: release only the KV cache and keep the weights on the GPU, which "
        "saves copying them to host memory and back each step (the weights of a small model are a "
        "sliver of the memory its cache takes)",
    )
    trainer_offload: bool = Field(
        False,
        description="the trainer moves its weights, gradients and optimizer state to host memory while "
        "the engines generate, and back before each step (costs the copies, about 2 x its state / PCIe "
        "bandwidth per step)",
    )
    trainer_onload_ahead: bool = Field(
        True,
        description="with trainer_offload: start taking the trainer's state back while the batch's last "
        "episodes still generate (timed from the last steps' waits and onloads), so that the copy is off "
        "the step's critical path; the state fits beside awake engines, as at start-up. Off: the onload "
        "starts once the batch is in",
    )
    overlap: bool = Field(
        False,
        description="the engines keep generating while the trainer steps, both resident on the one device "
        "and sharing its time; generation pauses only for the weight sync, as with placement "
        "disaggregated. Needs engine_sleep and trainer_offload off (and engine.mem_fraction leaving the "
        "trainer its room); what is generated during a step is one policy version behind",
    )


class EvalConfig(ConfigModel):
    """Held-out evaluation (greedy, one sample per task)."""

    interval: int = Field(0, ge=0, description="evaluate every N steps (0: only before and after training)")
    num_tasks: int | None = Field(None, ge=1, description="held-out tasks used (None: all)")
    before: bool = Field(True, description="evaluate before the first step")
    after: bool = Field(True, description="evaluate after the last step")


class CheckpointConfig(ConfigModel):
    """Trainer + rollout checkpoints under ``<output_dir>/checkpoints``."""

    interval: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")


class RayConfig(ConfigModel):
    """Where the actors run."""

    address: str | None = Field(None, description="an existing Ray cluster (None: start a local one)")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local Ray instance (None: all)")


class RunConfig(ConfigModel):
    """One training run of ``train_async.py``."""

    recipe: str = Field(
        "default",
        description="what the run does around the loop (its model and tasks, services, held-out figures, "
        "report): a registered recipe name or module:Class; see agentrl.recipe",
    )
    output_dir: str = Field("runs/run", description="metrics, checkpoints, plot, weights for the engines")
    seed: int = Field(0, description="seed of the run (rollout order, trainer init)")
    steps: int = Field(20, ge=0, description="training steps; each one is a weight sync (version + 1)")
    deterministic: bool = Field(
        False,
        description="two runs with the same seed give bit-identical weights and metrics (apart from timings) "
        "on one machine: seeded requests, batches and versions by the step (agentrl.rollout.lockstep), "
        "embedded engines with batch-invariant kernels (agentrl.batch_invariant: a request's bits do not "
        "depend on the batch, prefix reuse or prefill chunking, so batching and reuse stay on)",
    )
    model_path: str = Field(description="HF model dir, or pretrained:NAME (agentrl.models.pretrained)")
    data: DataConfig = Field(description="tasks")
    env: EnvConfig = Field(description="the env of every episode")
    engine: EngineSetupConfig = Field(default_factory=EngineSetupConfig, description="inference engines")
    placement: Literal["colocated", "disaggregated"] = Field(
        "disaggregated",
        description="colocated: engines and trainer share a device, so generation pauses while training; "
        "disaggregated: they run on separate devices and overlap",
    )
    weight_sync: Literal["disk", "distributed", "tensor"] = Field(
        "distributed",
        description="disk: HF safetensors + update_weights_from_disk (any engine that sees the disk); "
        "distributed: broadcast (NCCL / gloo; engines on other devices); tensor: in memory, "
        "update_weights_from_tensor with CUDA IPC handles (or shared memory on the CPU), for engines "
        "on the trainer's machine and GPU (placement: colocated)",
    )
    colocation: ColocationConfig = Field(
        default_factory=ColocationConfig, description="placement colocated: sleep / offload between phases"
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="orchestrator")
    trainer: TrainerConfig = Field(description="Megatron trainer (model_path defaults to the run's)")
    trainer_world_size: int = Field(1, ge=1, description="trainer ranks (tp * pp * dp), one Ray actor each")
    trainer_gpus_per_rank: float | None = Field(
        None,
        ge=0,
        description="GPUs Ray reserves per trainer rank (None: 0 on CPU; on cuda 1, or 0.5 when colocated)",
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray")
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="TensorBoard and wandb beside metrics.jsonl"
    )

    @model_validator(mode="before")
    @classmethod
    def _trainer_model_path(cls, data: Any) -> Any:
        if isinstance(data, dict):
            # the run's model_path (or its default, e.g. a recipe's "auto"); a missing one is reported
            # once, as model_path, not again under trainer and engine.sglang
            default = cls.model_fields["model_path"].default
            model_path = data.get("model_path", default if isinstance(default, str) else "")
            trainer = data.get("trainer")
            trainer = dict(trainer) if isinstance(trainer, dict) else ({} if trainer is None else trainer)
            if isinstance(trainer, dict):
                trainer.setdefault("model_path", model_path)
            data = {**data, "trainer": trainer}
            engine = data.get("engine")
            if isinstance(engine, dict) and isinstance(engine.get("sglang"), dict):
                sglang = dict(engine["sglang"])
                sglang.setdefault("model_path", model_path)
                data["engine"] = {**engine, "sglang": sglang}
        return data

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.trainer.moe.routing_replay:  # replay needs the engine's routing in every trajectory
            self.rollout.return_routed_experts = True
        if self.engine.backend == "external" and not self.engine.urls:
            raise ValueError("engine.urls: backend 'external' needs at least one URL")
        if self.engine.router and self.engine.backend != "external":
            raise ValueError(
                "engine.router: needs engine.backend: external (the router's URL in engine.urls)"
            )
        if self.deterministic and self.engine.backend != "embedded":
            raise ValueError(
                "deterministic: needs engine.backend: embedded (other engines batch requests with "
                "numerics that depend on what else runs; SGLang's batch-invariant mode is not wired up)"
            )
        share = 0.5 if self.placement == "colocated" else 1.0  # colocated: engine and trainer halve a GPU
        # sglang engines keep 0 unless set (give them tp_size GPUs); its launcher does not run here to guess
        engine_on_gpu = self.engine.backend == "embedded" and self.engine.device.startswith("cuda")
        trainer_on_gpu = self.trainer.device.startswith("cuda")
        if self.engine.gpus_per_engine is None:
            self.engine.gpus_per_engine = share if engine_on_gpu else 0.0
        if self.trainer_gpus_per_rank is None:
            self.trainer_gpus_per_rank = share if trainer_on_gpu else 0.0
        if engine_on_gpu and self.engine.gpus_per_engine == 0:
            raise ValueError(
                "engine.gpus_per_engine: an embedded engine on cuda needs a GPU share from Ray "
                "(an actor that reserves none sees no GPU); e.g. 1, or 0.5 when colocated"
            )
        if trainer_on_gpu and self.trainer_gpus_per_rank == 0:
            raise ValueError("trainer_gpus_per_rank: a trainer on cuda needs a GPU share from Ray")
        if (
            self.placement == "colocated"
            and self.weight_sync == "distributed"
            and engine_on_gpu
            and trainer_on_gpu
        ):
            raise ValueError(
                "weight_sync: NCCL cannot broadcast between two processes on one GPU; "
                "use weight_sync: tensor (or disk) when colocated"
            )
        if self.placement != "colocated":  # nothing to take turns on: the colocation switches do not apply
            self.colocation.engine_sleep = self.colocation.trainer_offload = self.colocation.overlap = False
        if self.colocation.overlap and (self.colocation.engine_sleep or self.colocation.trainer_offload):
            raise ValueError(
                "colocation.overlap: the engines generate while the trainer steps, so neither can give its "
                "memory up; set colocation.engine_sleep and colocation.trainer_offload to false"
            )
        if self.weight_sync == "tensor" and trainer_on_gpu and self.placement != "colocated":
            raise ValueError(
                "weight_sync: tensor passes CUDA IPC handles, which open only on the trainer's own GPU; "
                "with placement disaggregated use distributed"
            )
        if self.weight_sync == "tensor" and self.engine.backend == "external":
            raise ValueError(
                "weight_sync: tensor hands weights over in memory to engines this run starts on its own "
                "machine; engine.backend external may be elsewhere: use disk or distributed"
            )
        return self

    def gpus_needed(self) -> float:
        """GPUs that Ray must have for this run's engines and trainer ranks (checked before they start)."""
        engines = 0 if self.engine.backend == "external" else self.engine.num_engines
        return engines * (self.engine.gpus_per_engine or 0) + self.trainer_world_size * (
            self.trainer_gpus_per_rank or 0
        )
