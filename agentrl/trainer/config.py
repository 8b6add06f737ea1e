"""The Megatron trainer's configuration: model, parallelism, optimizer, micro-batching and loss
(:class:`TrainerConfig`, the ``trainer`` section of a run config)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from agentrl.config import ConfigModel
from agentrl.trainer.loss_config import LossConfig


class MoEConfig(ConfigModel):
    """Mixture-of-experts options (used only when the model is an MoE model)."""

    routing_replay: bool = Field(
        False,
        description="replay the engine's routing (R3): each router's top-k experts forced to the ones the "
        "engine recorded for the token (meta_info routed_experts), gates recomputed from the router's "
        "logits at them, in π_old and in the loss",
    )
    aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="load-balancing auxiliary loss coefficient (None: the model config's "
        "router_aux_loss_coef; 0: off). Logged as moe_aux_loss",
    )
    grouped_gemm: bool | Literal["auto"] = Field(
        "auto",
        description="run the experts with grouped GEMMs (agentrl.trainer.experts.GroupedExperts: "
        "each layer's local experts stacked in two weights, torch._grouped_mm on a CUDA sm90+ GPU "
        "in bf16, an exact per-expert loop elsewhere) instead of megatron-core's SequentialMLP "
        "(one matmul pair per expert). auto: grouped on CUDA. Same math and HF conversion either "
        "way; a trainer checkpoint resumes only under the layout it was saved with",
    )


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The HF module names a LoRA adapter may target (dense attention and MLP projections)."""


class LoRAConfig(ConfigModel):
    """Low-rank adapters (LoRA) on the attention and MLP projections; the base weights stay frozen
    (:mod:`agentrl.trainer.lora`)."""

    rank: int = Field(8, gt=0, description="adapter rank r")
    alpha: float = Field(
        16.0, gt=0, description="scale numerator: the adapter's output is (alpha / rank) B A x"
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the adapter's input (training only; needs trainer.tp = 1)"
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="HF module names to adapt: " + ", ".join(LORA_TARGETS),
    )

    @model_validator(mode="after")
    def _check(self) -> LoRAConfig:
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(
                f"trainer.lora.target_modules: unknown {', '.join(unknown)}; known: {', '.join(LORA_TARGETS)}"
            )
        return self


LORA_NOT_EXACT = (
    "{field}: not with trainer.lora: the engines apply the adapters with kernels of their own (unmerged or "
    "merged: engine.lora_apply), whose last bits differ from the trainer's W x + s*B(A x), so the run "
    "cannot be exact"
)


class TrainerConfig(ConfigModel):
    """Model, parallelism, optimizer, batching and loss of the Megatron trainer."""

    replaced_fields: ClassVar[dict[str, str]] = {"deterministic": "the run's top-level deterministic switch"}

    model_path: str = Field(..., description="HF model directory the weights (and shape) are loaded from")
    mcore_path: str | None = Field(
        None,
        description="optional Megatron dir (agentrl.convert "
        "hf-to-mcore) to load instead of model_path's weights",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="parameter dtype (bf16: fp32 main weights in the GPU optimizer)"
    )
    tp: int = Field(1, ge=1, description="tensor-parallel size")
    pp: int = Field(1, ge=1, description="pipeline-parallel size (GPU only)")
    ep: int = Field(
        1,
        ge=1,
        description="expert-parallel size (MoE models; divides the data-parallel size and the expert count)",
    )
    vocab_divisible_by: int = Field(
        1, ge=1, description="pad the vocabulary to a multiple of tp * this (128 is GPU-friendly)"
    )
    recompute_activations: bool = Field(
        False, description="full activation recomputation (memory for compute)"
    )
    seed: int = Field(1234, description="seed of torch / numpy / python RNGs")

    lr: float = Field(1e-6, gt=0, description="peak learning rate")
    min_lr: float = Field(0.0, ge=0, description="final learning rate of the decay")
    lr_warmup_steps: int = Field(0, ge=0, description="linear warmup, in optimizer steps")
    lr_decay_steps: int | None = Field(
        None, ge=1, description="decay length in optimizer steps (None: constant after warmup)"
    )
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR decay after warmup"
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(0.98, ge=0, lt=1, description="AdamW beta2")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="clip the global gradient norm to this (0 = off)")
    optimizer: Literal["auto", "megatron", "torch"] = Field(
        "auto", description="auto: megatron DDP + distributed optimizer on GPU, torch AdamW on CPU"
    )
    optimizer_cpu_offload: bool = Field(
        False,
        description="megatron path: keep the optimizer state (fp32 main weights, Adam moments) in host "
        "memory and run the Adam step on the CPU (megatron-core's optimizer_cpu_offload, all of it); "
        "frees GPU memory for a colocated engine at the cost of a slower step. On the CPU path it "
        "changes nothing (everything is there already)",
    )

    micro_batch_size: int = Field(4, ge=1, description="sequences per micro-batch")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="if set, micro-batches are filled up to this many padded tokens instead"
    )
    pack_sequences: bool = Field(
        False,
        description="micro-batches of sequences laid end to end up to max_tokens_per_micro_batch "
        "real tokens, attention within each sequence (no compute on padding; pp = 1 only)",
    )
    logprob_chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="if set, the LM head and the logprobs run this many tokens at a time inside the loss "
        "(no full fp32 [tokens, vocabulary] logits; pp = 1 only)",
    )
    old_logprobs: Literal["auto", "recompute"] = Field(
        "auto",
        description="decoupled mode's π_old: auto takes it from the update's own forward (detached) when the "
        "step makes one optimizer step, since π_old are then the very weights of that forward; recompute "
        "always runs a separate no-grad pass first",
    )
    compile_kernels: bool | None = Field(
        None,
        description="torch.compile the log-softmax / entropy math (logprobs.py) and megatron-core's fused "
        "kernels (its SwiGLU as bias_activation_fusion, the MoE router's expert-bias update); off, those "
        "run as plain torch code (megatron-core's, as the process first loads it). None: on CUDA "
        "(compiling on CPU takes longer than it saves)",
    )
    compile_layers: bool = Field(
        False,
        description="torch.compile each transformer layer (fuses norms, RoPE, residuals; cuts launches; "
        "the first step of each new shape compiles)",
    )
    true_on_policy: bool = Field(
        False,
        description="exactly on-policy: π_old and the loss's logprobs come from a forward in the embedded "
        "engine's batch-invariant kernels and reduction order (agentrl.batch_invariant), so for the same "
        "weights and tokens they equal the engine's logprobs bit for bit (mismatch KL 0, TIS weights 1); "
        "backward uses ordinary kernels. The run's engines then serve batch-invariant. tp = pp = 1",
    )
    num_mini_batches: int = Field(1, ge=1, description="optimizer steps per train_step (per epoch)")
    ppo_epochs: int = Field(1, ge=1, description="passes over the batch per train_step")
    loss: LossConfig = Field(default_factory=LossConfig, description="advantages and policy loss")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="mixture-of-experts options")
    lora: LoRAConfig | None = Field(
        None,
        description="train low-rank adapters instead of the full model (None: full fine-tuning); the "
        "engines then receive only the adapters (the embedded engine applies them as engine.lora_apply "
        "says; SGLang loads each version by name)",
    )
    weight_sync_bucket_mb: int = Field(
        512, ge=1, description="bucket size of the distributed weight broadcast"
    )
    weight_sync_flatten: bool = Field(
        False,
        description="distributed weight broadcast: each bucket as one broadcast of its bytes (SGLang's "
        "load_format flattened_bucket), one collective a bucket instead of one a tensor",
    )

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        """The checks that need only this section, at config load (the ones that need the model or the
        device ``auto`` resolves to run when the trainer is built)."""
        fixed_shapes = self.max_tokens_per_micro_batch is None and not self.pack_sequences
        if self.device == "cpu" and self.pp > 1:
            raise ValueError(
                "trainer.pp: pipeline parallelism needs CUDA (megatron's pipeline schedules are CUDA-bound)"
            )
        if self.device == "cpu" and self.optimizer == "megatron":
            raise ValueError("trainer.optimizer: megatron needs CUDA; use torch (or auto) on the CPU")
        if self.pp > 1 and (not fixed_shapes or self.loss.kl_coef > 0 or self.logprob_chunk_tokens):
            raise ValueError(
                "trainer.pp: pp > 1 needs fixed-size micro-batches (no max_tokens_per_micro_batch, no "
                "pack_sequences), no KL reference model (loss.kl_coef 0) and no logprob_chunk_tokens"
            )
        if self.pack_sequences and self.max_tokens_per_micro_batch is None:
            raise ValueError(
                "trainer.pack_sequences: needs max_tokens_per_micro_batch "
                "(the token budget of a packed micro-batch)"
            )
        if self.ep > 1 and not fixed_shapes:  # the MoE token all-gather over ep ranks needs equal shapes
            raise ValueError(
                "trainer.ep: ep > 1 needs fixed-size micro-batches "
                "(no max_tokens_per_micro_batch, no pack_sequences)"
            )
        if self.moe.routing_replay and (self.pp > 1 or self.recompute_activations):
            # recomputation would route the backward's forward again, outside the replayed micro-batch
            raise ValueError("trainer.moe.routing_replay: needs pp = 1 and no recompute_activations")
        if self.lora is not None:
            if (
                self.lora.dropout > 0 and self.tp > 1
            ):  # a replicated adapter input needs one mask on all ranks
                raise ValueError(
                    "trainer.lora.dropout: needs trainer.tp = 1 (dropout 0 with tensor parallelism)"
                )
            if self.true_on_policy:
                raise ValueError(LORA_NOT_EXACT.format(field="trainer.true_on_policy"))
        return self
