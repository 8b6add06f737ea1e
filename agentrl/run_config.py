"""RunConfig: the one validated config of a ``train_async.py`` run, composed of the components' configs.

Loaded from one YAML file plus ``key=value`` overrides (``rollout.group_size=4 trainer.lr=1e-4``) by
:func:`agentrl.recipe.load_run_config`; any unknown or invalid field fails with its dotted path. This is
the generic part, the same for every env and verifier. A run's ``recipe`` (:mod:`agentrl.recipe`) may
validate it with a subclass that adds its own sections, as the Search-R1 demo adds ``bootstrap`` and
``retrieval``. ``trainer.model_path`` defaults to the run's ``model_path``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from agentrl.cluster import Listen
from agentrl.config import ConfigModel
from agentrl.embedded.speculative_config import SpeculativeConfig
from agentrl.engine.sglang_config import SGLangConfig
from agentrl.exactness import Exactness
from agentrl.metrics import MetricsConfig
from agentrl.rollout.config import RolloutConfig
from agentrl.run_checks import (
    check_lora,
    check_quantization,
    check_shards,
    engine_on_gpu,
    engine_tp,
    sglang_speculates,
    trainer_on_gpu,
)
from agentrl.trainer.config import LORA_NOT_EXACT, TrainerConfig
from agentrl.weight_sync import Transport, check_transport


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
    quantization: Literal["fp8"] | None = Field(
        None,
        description="fp8: the engines serve the decoder's linear weights in float8 e4m3, re-quantized "
        "from the trainer's weights at every sync, and token TIS corrects the mismatch (embedded: a "
        "scale per output channel, Llama / Qwen2 / Qwen3 and Qwen3-MoE models, experts included, a "
        "GPU of compute capability 8.9+ with engine.dtype bfloat16, a CPU runs the same arithmetic "
        "unfused; sglang: --quantization fp8). Not with deterministic or trainer.true_on_policy",
    )
    lora_apply: Literal["unmerged", "merged"] = Field(
        "unmerged",
        description="embedded, with trainer.lora: how the engines serve the synced "
        "adapters. unmerged: beside the weights, x W^T + s (x A^T) B^T as the trainer "
        "computes it, a sync copying only the adapters into buffers of trainer.lora.rank "
        "(a few % more work per token); merged: W + s B A written into the weights from "
        "host copies of the base, a sync moving every adapted weight (no work per token)",
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
    speculative: SpeculativeConfig | None = Field(
        None,
        description="embedded: speculative decoding, drafts from each request's own context verified in "
        "one forward (agentrl.embedded.speculative; exact acceptance changes no token). SGLang's own "
        "goes through engine.sglang (docs/guide/speculative-decoding.md)",
    )

    @model_validator(mode="after")
    def _speculative_is_embedded(self) -> EngineSetupConfig:
        if self.speculative is not None and self.backend != "embedded":
            raise ValueError(
                "engine.speculative is the embedded engine's; SGLang's goes through engine.sglang"
            )
        return self


class ColocationConfig(ConfigModel):
    """``placement: colocated``: how the engines and the trainer share each GPU (:mod:`agentrl.handover`).

    ``mode: turns`` (slime's colocation): generation pauses while the trainer steps, and each side may give
    its GPU memory up while the other works (``engine_release``, ``trainer_offload``). ``mode: overlap``:
    both stay resident and the engines keep generating beside the step, pausing for the weight sync only,
    as disaggregated engines do; what they generate during a step is one policy version behind."""

    replaced_fields: ClassVar[dict[str, str]] = {
        "engine_sleep": "colocation.engine_release: all | kv_cache | none",
        "engine_keep_weights": "colocation.engine_release: kv_cache (keep the weights, release the KV cache)",
        "trainer_onload_ahead": "colocation.trainer_offload: ahead | after_batch | none",
        "overlap": "colocation.mode: overlap (or turns)",
    }

    mode: Literal["turns", "overlap"] = Field(
        "turns",
        description="turns: generation pauses while the trainer steps; overlap: the engines generate beside "
        "the step (engine.mem_fraction must leave the trainer its room) and pause for the weight sync only",
    )
    engine_release: Literal["all", "kv_cache", "none"] | None = Field(
        None,
        description="turns: what the engines release while the trainer steps (SGLang's "
        "/release_memory_occupation; SGLang engines get --enable-memory-saver): all = KV cache and weights "
        "(lets engine.mem_fraction go to 0.7+), kv_cache = keep the weights (a small model's weights are a "
        "sliver of its cache), none. Default: all with turns; overlap needs none",
    )
    trainer_offload: Literal["ahead", "after_batch", "none"] | None = Field(
        None,
        description="turns: the trainer moves its weights, gradients and optimizer state to host "
        "memory while the engines generate (costs about 2 x its state / PCIe bandwidth a step) "
        "and takes them back before the step: ahead = the onload starts while the batch's last "
        "episodes still generate (timed from the last steps), after_batch = once the batch is "
        "in, none = the state stays on the GPU. Default: ahead with turns; overlap needs none",
    )

    @model_validator(mode="before")
    @classmethod
    def _offload_was_a_switch(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("trainer_offload"), bool):
            raise ValueError(
                "trainer_offload is no longer a switch: "
                "colocation.trainer_offload: ahead | after_batch | none"
            )
        return data

    @model_validator(mode="after")
    def _by_mode(self) -> ColocationConfig:
        turns = self.mode == "turns"
        if self.engine_release is None:
            self.engine_release = "all" if turns else "none"
        if self.trainer_offload is None:
            self.trainer_offload = "ahead" if turns else "none"
        if not turns and (self.engine_release != "none" or self.trainer_offload != "none"):
            raise ValueError(
                "colocation.mode overlap: the engines generate while the trainer steps, so neither side can "
                "give its memory up; leave colocation.engine_release and colocation.trainer_offload unset"
            )
        return self


class EvalConfig(ConfigModel):
    """Held-out evaluation (greedy, one sample per task)."""

    interval: int = Field(0, ge=0, description="evaluate every N steps (0: only before and after training)")
    num_tasks: int | None = Field(None, ge=1, description="held-out tasks used (None: all)")
    before: bool = Field(True, description="evaluate before the first step")
    after: bool = Field(True, description="evaluate after the last step")


class CheckpointConfig(ConfigModel):
    """Trainer + rollout checkpoints under ``<output_dir>/checkpoints``."""

    interval: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    at_end: bool = Field(
        True, description="also after the last step (off: a run that only measures writes none at the end)"
    )

    def due(self, step: int) -> bool:
        """Whether training step ``step`` (1-based) ends with an interval checkpoint."""
        return self.interval > 0 and step % self.interval == 0


class RayConfig(ConfigModel):
    """Where the actors run: a local Ray instance or a cluster, and which nodes take the engines and the
    trainer ranks (custom Ray resources, as ``ray start --resources`` declares them on a node)."""

    address: str | None = Field(
        None, description="an existing Ray cluster: auto, or the head's HOST:PORT (None: start a local one)"
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local Ray instance (None: all)")
    engine_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each engine actor asks for beside its GPUs, e.g. {engine_node: 1} "
        "to put the engines on the nodes started with ray start --resources '{\"engine_node\": 8}'; "
        "colocated, every GPU's bundle holds them with the trainer rank's",
    )
    trainer_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each trainer rank asks for beside its GPUs, e.g. {trainer_node: 1}",
    )
    rollout_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each rollout shard asks for (the episodes, envs and tools run "
        "there), e.g. {rollout_node: 1}",
    )
    service_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each of the recipe's servers asks for (the Search-R1 /retrieve "
        "server), e.g. {service_node: 1}",
    )
    listen: Listen = Field(
        "auto",
        description="where the servers the run starts listen: auto = loopback on one host, each node's "
        "routable address (AGENTRL_NODE_ADDRESS, else Ray's node IP) when the Ray cluster's nodes have "
        "more than one address; off loopback they require the run's secret (engine.api_key, else "
        "AGENTRL_RUN_SECRET, else generated), handed to every client",
    )

    @field_validator("engine_resources", "trainer_resources", "rollout_resources", "service_resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU"):
                raise ValueError(
                    f"{name} is not a custom resource: GPUs come from engine.gpus_per_engine and "
                    "trainer_gpus_per_rank"
                )
            if amount <= 0 or round(amount * 10_000) == 0:  # Ray counts resources in 1e-4 units
                raise ValueError(f"{name}: {amount:g} is no amount Ray can reserve (0.0001 or more)")
        return value


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
        "depend on the batch, prefix reuse or prefill chunking, so batching and reuse stay on), SGLang "
        "engines with --enable-deterministic-inference; the one switch every component reads",
    )
    model_path: str = Field(description="HF model dir, or pretrained:NAME (agentrl.models.pretrained)")
    data: DataConfig = Field(description="tasks")
    env: EnvConfig = Field(description="the env of every episode")
    engine: EngineSetupConfig = Field(default_factory=EngineSetupConfig, description="inference engines")
    placement: Literal["colocated", "disaggregated"] = Field(
        "disaggregated",
        description="colocated: engine i and trainer rank i share GPU i, as "
        "colocation says (taking turns, or overlapped); disaggregated: engines "
        "and trainer on devices of their own, generating beside the step",
    )
    weight_sync: Transport = Field(
        "distributed",
        description="disk: HF safetensors + update_weights_from_disk (any engine that sees the disk); "
        "distributed: broadcast (NCCL / gloo; engines on other devices); tensor: in memory, "
        "update_weights_from_tensor with CUDA IPC handles (or shared memory on the CPU), for engines "
        "on the trainer's machine and GPU (placement: colocated)",
    )
    colocation: ColocationConfig = Field(
        default_factory=ColocationConfig,
        description="placement colocated: turns or overlap, and "
        "what each side releases (ignored when disaggregated)",
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
    def _resolve(self) -> RunConfig:
        """The values the config derives from its other fields, filled in once, before :meth:`_check`: the
        GPU shares Ray reserves for each engine and trainer rank (an engine or a trainer on a GPU takes one
        per GPU it uses, half of it when colocated; 0 off the GPU), and the engine's routing in every
        trajectory when the trainer replays it."""
        e = self.engine
        share = 0.5 if self.placement == "colocated" else 1.0  # colocated: engine and trainer halve a GPU
        if e.gpus_per_engine is None:
            e.gpus_per_engine = share * engine_tp(self) if engine_on_gpu(self) else 0.0
        if self.trainer_gpus_per_rank is None:
            self.trainer_gpus_per_rank = share if trainer_on_gpu(self) else 0.0
        if self.trainer.moe.routing_replay:  # replay needs the engine's routing in every trajectory
            self.rollout.return_routed_experts = True
        return self

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        """Every check that needs only the config, naming the fields (the model's shape is checked by
        :func:`agentrl.run_checks.check_model_shape` once the recipe resolved it; Ray's GPUs by
        agentrl.placement). It changes nothing: derived values are :meth:`_resolve`'s."""
        e, t = self.engine, self.trainer
        if e.backend == "external" and not e.urls:
            raise ValueError("engine.urls: backend 'external' needs at least one URL")
        if self.ray.engine_resources and e.backend == "external":
            raise ValueError("ray.engine_resources: engine.backend external starts no engine actors to place")
        if e.router and e.backend != "external":
            raise ValueError(
                "engine.router: needs engine.backend: external (the router's URL in engine.urls)"
            )
        run_sets = {
            "deterministic": "deterministic",
            "memory_saver": "colocation.engine_release",
            "quantization": "engine.quantization",
            "lora": "trainer.lora",
        }
        for field, instead in run_sets.items():
            if e.sglang is not None and field in e.sglang.model_fields_set:
                raise ValueError(f"engine.sglang.{field}: the run sets it from {instead}; set that instead")
        if t.true_on_policy and e.backend != "embedded":
            raise ValueError(
                "trainer.true_on_policy: needs engine.backend: embedded, not "
                f"{e.backend} (the engine is exact because it runs the trainer's "
                "own batch-invariant kernels; another engine's logprobs differ)"
            )
        if e.quantization is not None:
            check_quantization(self)
        if self.deterministic and e.backend == "external":
            raise ValueError(
                "deterministic: needs engines this run starts (engine.backend: embedded, or sglang with its "
                "deterministic inference); external engines batch with numerics the run cannot fix"
            )
        if self.deterministic and t.lora is not None:
            raise ValueError(LORA_NOT_EXACT.format(field="deterministic"))
        if self.deterministic and sglang_speculates(self):
            raise ValueError(
                "engine.sglang.extra_args: speculative-algorithm with deterministic: SGLang's verify step "
                "does not repeat tokens (its draws ignore sampling_seed; greedy flips with the draft's "
                "shapes); use the embedded engine's engine.speculative, which changes no token"
            )
        if t.lora is not None:
            check_lora(self)
        exact_forward = self.exactness.trainer_kernels(on_gpu=t.device == "cuda").exact_logprobs
        if exact_forward and (t.tp, t.pp) != (1, 1):
            field = "trainer.true_on_policy" if t.true_on_policy else "deterministic"
            raise ValueError(f"{field}: the exact forward needs trainer.tp = 1 and trainer.pp = 1")
        for what, size in (("tp * pp", t.tp * t.pp), ("tp * pp * ep", t.tp * t.pp * t.ep)):
            if self.trainer_world_size % size:
                raise ValueError(
                    f"trainer_world_size: {self.trainer_world_size} ranks are not a "
                    f"multiple of trainer {what} = {size} (the ranks are tp x pp x dp)"
                )
        colocated = self.placement == "colocated"
        gpus_an_engine = engine_tp(self)
        trainer_gpu = trainer_on_gpu(self)
        if engine_on_gpu(self) and e.gpus_per_engine == 0:
            raise ValueError(
                "engine.gpus_per_engine: an engine on a GPU needs a GPU share from Ray (an actor that "
                "reserves none sees no GPU); e.g. 1, or 0.5 when colocated"
            )
        if trainer_gpu and self.trainer_gpus_per_rank == 0:
            raise ValueError("trainer_gpus_per_rank: a trainer on cuda needs a GPU share from Ray")
        on_gpus = self.colocated_on_gpus()
        if on_gpus and self.trainer_world_size != e.num_engines * gpus_an_engine:
            raise ValueError(
                "engine.num_engines: colocated, engine i and trainer rank i share GPU i, "
                f"so the engines' GPUs (num_engines x tp = {e.num_engines * gpus_an_engine}) "
                f"must equal trainer_world_size ({self.trainer_world_size})"
            )
        check_transport(
            self.weight_sync,
            colocated=colocated,
            on_gpus=on_gpus,
            trainer_on_gpu=trainer_gpu,
            engine_backend=e.backend,
            placed_apart=self.ray.engine_resources.keys() != self.ray.trainer_resources.keys(),
        )
        if self.rollout.shards > 1:
            check_shards(self)
        return self

    @property
    def exactness(self) -> Exactness:
        """What ``deterministic`` and ``trainer.true_on_policy`` turn on: the engines' and the trainer's
        kernels, seeded requests, the rollout's schedule (agentrl.exactness)."""
        return Exactness.resolve(self.deterministic, self.trainer.true_on_policy)

    def colocated_on_gpus(self) -> bool:
        """Engine i and trainer rank i share GPU i: placement colocated, with both the engines and the
        trainer ranks reserving GPU shares (as resolved). The one test of it (agentrl.placement pairs them
        on a placement group's bundles then; weight sync cannot broadcast between them)."""
        shares = bool(self.engine.gpus_per_engine) and bool(self.trainer_gpus_per_rank)
        return self.placement == "colocated" and shares

    def gpus_needed(self) -> float:
        """GPUs that Ray must have for this run's engines and trainer ranks (checked before they start)."""
        engines = 0 if self.engine.backend == "external" else self.engine.num_engines
        return engines * (self.engine.gpus_per_engine or 0) + self.trainer_world_size * (
            self.trainer_gpus_per_rank or 0
        )
