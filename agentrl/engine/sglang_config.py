"""What an SGLang server and an sglang-router are asked for: their typed configs.

:class:`SGLangConfig` is one server (``python -m sglang.launch_server``): its model, GPUs, memory, address
and key, and the flags agentrl's own use of SGLang needs, each a field with its reason (token ids in and
out, raw logprobs, the memory saver, deterministic inference, fp8, routing records, LoRA); free-form flags
pass through ``extra_args``. :class:`SGLangLoRAConfig` is the room a server keeps for adapters, in SGLang's
module names. :class:`SGLangRouterConfig` is a router in front of several servers. Starting and stopping
them is :mod:`agentrl.engine.launcher`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from pydantic import Field, model_validator

from agentrl.cluster import require_key_off_loopback
from agentrl.config import ConfigModel

SITE_ENV = "AGENTRL_SGLANG_SITE"  # where SGLang installed apart is, when set (see sglang_site)


SGLANG_LORA_MODULES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "o_proj": "o_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
}


class SGLangLoRAConfig(ConfigModel):
    """LoRA serving (``--enable-lora``): the room SGLang keeps for adapters, which it applies to the requests
    that name them (``lora_path``), beside the resident base weights."""

    max_rank: int = Field(..., gt=0, description="--max-lora-rank: the largest adapter rank that loads")
    target_modules: list[str] = Field(
        ...,
        min_length=1,
        description="--lora-target-modules: SGLang's module "
        "names (qkv_proj, o_proj, gate_up_proj, down_proj)",
    )
    max_loaded: int = Field(
        2,
        ge=1,
        description="--max-loaded-loras: adapters held at once (the served one and the one swapped in)",
    )
    max_per_batch: int = Field(
        2, ge=1, description="--max-loras-per-batch: adapters (the base model counting as one) a batch mixes"
    )

    @model_validator(mode="after")
    def _check(self) -> SGLangLoRAConfig:
        unknown = sorted(set(self.target_modules) - set(SGLANG_LORA_MODULES.values()))
        if unknown:
            raise ValueError(
                f"target_modules: {', '.join(unknown)} are not SGLang module names "
                f"({', '.join(sorted(set(SGLANG_LORA_MODULES.values())))})"
            )
        if self.max_loaded < self.max_per_batch:  # SGLang refuses to start otherwise
            raise ValueError(f"max_loaded: {self.max_loaded} is below max_per_batch ({self.max_per_batch})")
        return self

    @classmethod
    def for_adapters(cls, rank: int, hf_modules: Sequence[str]) -> SGLangLoRAConfig:
        """Room for adapters of ``rank`` on ``hf_modules`` (HF names: ``q_proj``, ...), in SGLang's names."""
        fused = {SGLANG_LORA_MODULES[m] for m in hf_modules}
        order = dict.fromkeys(SGLANG_LORA_MODULES.values())  # qkv, o, gate_up, down; each once
        return cls(max_rank=rank, target_modules=[m for m in order if m in fused])


class SGLangConfig(ConfigModel):
    """One SGLang server (``python -m sglang.launch_server``)."""

    model_path: str = Field(..., description="HF checkpoint directory or hub id the server loads")
    tp_size: int = Field(1, ge=1, description="tensor-parallel GPUs of this server (--tp-size)")
    mem_fraction_static: float | None = Field(
        None, gt=0.0, lt=1.0, description="GPU memory fraction for weights + KV cache (--mem-fraction-static)"
    )
    host: str = Field(
        "127.0.0.1",
        description="bind address; non-loopback needs api_key; 'node': the routable address of the node "
        "the server starts on",
    )
    port: int = Field(
        30000,
        ge=0,
        le=65535,
        description="HTTP port; 0 picks a free one at start "
        "(another if it is taken before the server binds it)",
    )
    api_key: str | None = Field(None, description="--api-key; clients send it as a Bearer token")
    extra_args: dict[str, Any] = Field(
        default_factory=dict,
        description="pass-through flags: {'context-length': "
        "8192, 'enable-metrics': true} (also --sglang-* keys)",
    )
    skip_tokenizer_init: bool | None = Field(
        None,
        description="--skip-tokenizer-init: token ids in and out, no tokenizer in the server. SGLang then "
        "refuses stop strings, so None (auto) skips it only when model_path holds no tokenizer; set false "
        "for envs that stop on strings (Search-R1's </search>), true to save the detokenizer's work",
    )
    attention_backend: str | None = Field(
        "triton",
        description="--attention-backend: triton needs no JIT build at start and no FA3 library (not in the "
        "offline bundle); None: SGLang's choice (fa3 on Hopper)",
    )
    sampling_backend: str | None = Field(
        "pytorch", description="--sampling-backend: pytorch needs no flashinfer JIT build; None: SGLang's"
    )
    memory_saver: bool = Field(
        False,
        description="--enable-memory-saver: /release_memory_occupation and /resume_memory_occupation work "
        "(a colocated engine gives its GPU memory to the trainer); set by colocated runs",
    )
    weights_cpu_backup: bool = Field(
        False,
        description="--enable-weights-cpu-backup: released weights come back with their content. Without it "
        "they come back as garbage, which is fine when new weights are pushed after every resume (agentrl's "
        "colocated step does), and saves a host copy of the weights",
    )
    deterministic: bool = Field(
        False,
        description="--enable-deterministic-inference: batch-invariant kernels, so a request's tokens do not "
        "depend on what else the server batches (seeded requests repeat exactly); set by a run from its "
        "deterministic switch",
    )
    quantization: str | None = Field(
        None,
        description="--quantization: fp8 quantizes a bf16 checkpoint's linear weights to fp8 as it loads "
        "(online quantization; an fp8 checkpoint needs no flag), with --load-format flash_rl so that weights "
        "pushed later are quantized again; set by a run from engine.quantization",
    )
    return_routed_experts: bool = Field(
        False,
        description="--enable-return-routed-experts: a mixture-of-experts server reports the experts it "
        "routed every input position to (meta_info routed_experts), which routing replay trains with; set "
        "by a run from rollout.return_routed_experts",
    )
    lora: SGLangLoRAConfig | None = Field(
        None,
        description="--enable-lora and the adapters' room (max rank, target modules, two adapters loaded at "
        "once); set by a run from trainer.lora",
    )
    site_dir: str | None = Field(
        None,
        description="directory with SGLang installed apart (scripts/gpu_setup.sh --sglang), "
        f"put first on the servers' PYTHONPATH; None: ${SITE_ENV}, else $AGENTRL_CACHE/sglang "
        "when it holds sglang, else none (sglang must import in `python`)",
    )
    python: str = Field(
        default_factory=lambda: sys.executable, description="python that runs sglang (with site_dir)"
    )
    module: str = Field("sglang.launch_server", description="module run with python -m")
    env: dict[str, str] = Field(
        default_factory=dict, description="extra environment variables for the server"
    )
    return_original_logprob: bool = Field(
        True,
        description="set SGLANG_RETURN_ORIGINAL_LOGPROB=1: logprobs of the raw model (before temperature), "
        "what the trainer recomputes and what the embedded engine returns",
    )
    log_file: str | None = Field(
        None, description="server stdout+stderr (default: a temp file, removed when the server stops)"
    )
    startup_timeout: float = Field(900.0, gt=0, description="seconds to wait for /health")
    stop_grace: float = Field(15.0, ge=0, description="seconds between SIGTERM and SIGKILL on stop")

    @model_validator(mode="after")
    def _check_exposure(self) -> SGLangConfig:
        require_key_off_loopback(self.host, self.api_key)
        return self


class SGLangRouterConfig(ConfigModel):
    """An sglang-router in front of several servers (``python -m sglang_router.launch_router``)."""

    worker_urls: list[str] = Field(..., min_length=1, description="URLs of the SGLang servers behind it")
    host: str = Field("127.0.0.1", description="bind address of the router")
    port: int = Field(
        30000,
        ge=0,
        le=65535,
        description="router port; 0 picks a free one (another if it is taken before the router binds it)",
    )
    policy: str = Field("cache_aware", description="cache_aware | round_robin | random | power_of_two")
    api_key: str | None = Field(None, description="API key the router checks and forwards")
    extra_args: dict[str, Any] = Field(default_factory=dict, description="pass-through router flags")
    python: str = Field(default_factory=lambda: sys.executable, description="python that has sglang-router")
    module: str = Field("sglang_router.launch_router", description="module run with python -m")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    log_file: str | None = Field(
        None, description="router stdout+stderr (default: a temp file, removed when the router stops)"
    )
    startup_timeout: float = Field(120.0, gt=0, description="seconds to wait for /health")
    stop_grace: float = Field(10.0, ge=0, description="seconds between SIGTERM and SIGKILL on stop")

    @model_validator(mode="after")
    def _check_exposure(self) -> SGLangRouterConfig:
        require_key_off_loopback(self.host, self.api_key)
        return self
