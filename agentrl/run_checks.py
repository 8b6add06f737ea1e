"""The run config's checks that span components (:class:`agentrl.run_config.RunConfig` calls them while it
validates): where engines and trainer ranks run, SGLang's flags, LoRA serving, rollout shards and engine
quantization; and the two checks a run makes once the config is valid, before anything starts: the model's
shape against the parallelism (:func:`check_model_shape`) and the registered names (:func:`check_names`).
Each raises naming the field."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentrl.config import ConfigError

if TYPE_CHECKING:
    from agentrl.run_config import RunConfig


def engine_on_gpu(cfg: RunConfig) -> bool:
    """Whether the run's engines take GPUs (SGLang always; the embedded engine on a cuda device)."""
    e = cfg.engine
    return e.backend == "sglang" or (e.backend == "embedded" and e.device.startswith("cuda"))


def trainer_on_gpu(cfg: RunConfig) -> bool:
    """Whether the trainer ranks run on GPUs."""
    return cfg.trainer.device.startswith("cuda")


def sglang_flags(cfg: RunConfig) -> dict[str, Any]:
    """The run's ``engine.sglang.extra_args`` keyed by flag name (``--dp_size`` and ``dp-size`` alike);
    empty unless the run starts SGLang engines."""
    e = cfg.engine
    extra = e.sglang.extra_args if e.backend == "sglang" and e.sglang else {}
    return {str(k).lstrip("-").replace("_", "-"): v for k, v in extra.items()}


def sglang_speculates(cfg: RunConfig) -> bool:
    """Whether the run's SGLang servers get ``--speculative-algorithm`` (``engine.sglang.extra_args``)."""
    return "speculative-algorithm" in sglang_flags(cfg)


def engine_tp(cfg: RunConfig) -> int:
    """GPUs one engine spans (an SGLang server's tensor parallelism)."""
    e = cfg.engine
    return e.sglang.tp_size if e.backend == "sglang" and e.sglang else 1


def check_lora(cfg: RunConfig) -> None:
    """``trainer.lora``: engines the run starts, which take adapters at run time. The embedded engine applies
    its adapter to every request; SGLang (0.5.16) keeps the base weights resident and serves each synced
    adapter to the requests that name it (agentrl.weight_sync.named_adapters), which needs its weights kept
    through a colocated release and a single data-parallel replica per server."""
    e = cfg.engine
    if e.backend == "external":
        raise ValueError(
            "trainer.lora: needs engine.backend: embedded or sglang, not external (the run starts those with "
            "LoRA serving on; an external engine may not load adapters at run time)"
        )
    if e.backend != "sglang":
        return
    extra = sglang_flags(cfg)
    for key in ("dp-size", "dp"):
        if int(extra.get(key) or 1) > 1:
            raise ValueError(
                f"engine.sglang.extra_args: {key} {extra[key]} with trainer.lora: "
                "SGLang loads adapters at run time only with one data-parallel "
                "replica; run more engines (engine.num_engines) instead"
            )
    backup = e.sglang is not None and e.sglang.weights_cpu_backup
    if cfg.placement == "colocated" and cfg.colocation.engine_release == "all" and not backup:
        raise ValueError(
            "colocation.engine_release: all releases SGLang's weights while the trainer steps, and with "
            "trainer.lora only adapters come back: set engine.sglang.weights_cpu_backup: true (the base "
            "weights return from host memory) or colocation.engine_release: kv_cache"
        )


def check_shards(cfg: RunConfig) -> None:
    """``rollout.shards`` > 1: the batch, the concurrency and the engines split evenly over the shards, each
    shard driving engines of its own (agentrl.rollout.shards). An agent env's proxy listens on a free port
    of its shard's process, so agent envs shard too."""
    e, n = cfg.engine, cfg.rollout.shards
    cfg.rollout.check_shards()
    if e.router:
        raise ValueError(
            f"rollout.shards: {n} shards need engines of their own, but engine.router spreads every request "
            "over all the router's workers; use rollout.shards: 1 with a router, or list the workers in "
            "engine.urls without engine.router"
        )
    engines, field = (
        (len(e.urls), "engine.urls") if e.backend == "external" else (e.num_engines, "engine.num_engines")
    )
    if engines % n:
        raise ValueError(
            f"{field}: {engines} engines cannot be split evenly over rollout.shards = {n} (shard i drives "
            f"engines i*k .. (i+1)*k-1, k = engines / shards)"
        )


def check_quantization(cfg: RunConfig) -> None:
    """``engine.quantization``: the engine's weights differ from the trainer's by design, so nothing that
    promises equal logprobs goes with it; an embedded engine on a visible GPU must have fp8 GEMMs (when no
    GPU is visible here, the engine server checks its own at start)."""
    e, q = cfg.engine, cfg.engine.quantization
    if cfg.deterministic:
        raise ValueError(
            f"engine.quantization: {q} serves weights that differ from the trainer's; deterministic promises "
            "the trainer's logprobs bit for bit: turn one off"
        )
    if cfg.trainer.true_on_policy:
        raise ValueError(
            f"engine.quantization: {q} serves weights that differ from the trainer's; "
            "trainer.true_on_policy needs the engine's logprobs equal to the trainer's: turn one off"
        )
    if e.backend == "external":
        raise ValueError(
            f"engine.quantization: {q} is set when the run starts the engines, not for external ones"
        )
    if e.backend == "embedded" and e.device.startswith("cuda"):
        if e.dtype != "bfloat16":  # the fp8 GEMM's rowwise scaling writes bf16
            raise ValueError(f"engine.quantization: {q} on cuda needs engine.dtype: bfloat16, not {e.dtype}")
        import torch

        if torch.cuda.is_available():
            from agentrl.embedded.fp8 import check_fp8_device

            index = torch.device(e.device).index
            try:
                check_fp8_device(torch.device("cuda", 0 if index is None else index))
            except ValueError as err:
                raise ValueError(f"engine.quantization: {err}") from None


def check_model_shape(cfg: RunConfig, model_dir: str) -> None:
    """The checks that need the model's shape (its HF ``config.json``, once the recipe resolved the model):
    tensor parallelism must divide the attention heads and the KV heads, and an embedded engine's
    ``engine.quantization`` must cover the model's family. Raises ConfigError naming the field, before Ray
    or any engine starts."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return  # not an HF directory here (a hub id an SGLang server resolves itself)
    shape = json.loads(path.read_text())
    shape = shape.get("text_config", shape)
    if cfg.engine.quantization == "fp8" and cfg.engine.backend == "embedded":
        from agentrl.embedded.fp8 import FP8_MODEL_TYPES

        model_type = shape.get("model_type")
        if model_type not in FP8_MODEL_TYPES:
            raise ConfigError(
                "engine.quantization: fp8 in the embedded engine covers the "
                f"{', '.join(FP8_MODEL_TYPES)} families, not {model_type!r} "
                f"({model_dir}); serve it unquantized or with engine.backend: sglang"
            )
    heads = int(shape.get("num_attention_heads", 0))
    kv_heads = int(shape.get("num_key_value_heads") or heads)
    sizes = {"trainer.tp": cfg.trainer.tp}
    if cfg.engine.backend == "sglang" and cfg.engine.sglang:
        sizes["engine.sglang.tp_size"] = cfg.engine.sglang.tp_size
    for field, tp in sizes.items():
        if heads % tp or (field == "trainer.tp" and kv_heads % tp):
            raise ConfigError(
                f"{field}: {tp} does not divide the model's {heads} attention heads and {kv_heads} KV heads "
                f"({model_dir}); pick a tp that divides both"
            )


def check_names(cfg: RunConfig) -> None:
    """The names the config gives registered parts resolve: ``env.name``, ``rollout.verifier`` (else the
    verifier the env names: its ``verifier`` argument or class attribute) and the tools of ``env.kwargs``
    (``tools``, ``extra_tools``); with ``rollout.tree``, that the env can fork (:mod:`agentrl.envs.fork`).
    A ``module:attr`` name imports its module here, so user code that fails to
    import fails now. Raises a one-line ConfigError naming the field and the nearest known names, before
    any bootstrap, dataset, Ray or engine starts."""
    from agentrl.envs.registry import ENVS
    from agentrl.rewards.base import VERIFIERS
    from agentrl.tools.registry import check_tool_specs

    def lookup(registry: Any, name: str, field: str) -> Any:
        try:
            return registry.get(name)
        except KeyError as err:
            missing = "No module named" in err.args[0]
            hint = " (is its module in the working directory or on PYTHONPATH?)" if missing else ""
            raise ConfigError(f"{field}: {err.args[0]}{hint}") from None

    factory = lookup(ENVS, cfg.env.name, "env.name")
    kwargs = cfg.env.kwargs
    if cfg.rollout.verifier:
        lookup(VERIFIERS, cfg.rollout.verifier, "rollout.verifier")
    elif isinstance(kwargs.get("verifier"), str):
        lookup(VERIFIERS, kwargs["verifier"], "env.kwargs.verifier")
    elif isinstance(getattr(factory, "verifier", None), str):
        lookup(VERIFIERS, factory.verifier, f"env {cfg.env.name!r}'s verifier attribute")
    for key in ("tools", "extra_tools"):
        try:
            check_tool_specs(kwargs.get(key), f"env.kwargs.{key}")
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if cfg.rollout.tree is not None and isinstance(factory, type):  # tree rollouts fork the env
        from agentrl.envs.fork import check_forkable

        try:
            check_forkable(factory, cfg.env.name)
        except ValueError as err:
            raise ConfigError(f"env.name: {err}") from None
