"""A whole RL step at a model's real shape with random weights: what each part of a step costs at 7B or
30B-A3B, on the engines, trainer and placement the run config names.

``prepare`` builds, once, a random model of ``scale.shape`` (:mod:`agentrl.models.random_weights`; drawn on
``scale.device``, cached under ``scale.cache_dir``), unless ``model_path`` names a checkpoint, and makes
``scale.num_tasks`` single-turn tasks whose prompts are about ``scale.prompt_tokens`` tokens of random
text. :class:`ScaleEnv` ends an episode after the model's first response (up to
``rollout.sampling.max_new_tokens``; a random model rarely samples its end token, so responses run to the
limit), and the ``letter_share`` verifier scores the share of the response's visible characters that are
letters: a property of the sampled tokens, so the rewards of a group differ and GRPO has advantages to
train on. What the policy learns means nothing; what the step costs is the point.

The summary adds, over the steps after the first (warm-up): the step's parts (waiting for the batch,
training, weight sync), generated tokens/s per engine GPU, trainer tokens/s per trainer GPU and the
update's MFU (6 × active parameters × tokens / (GPUs × ``scale.peak_tflops``); attention's FLOPs left
out, so it is a floor), weight-sync seconds and GB/s (the model's bytes in its dtype over the sync's
seconds, the weights in the trainer's dtype), and the trainer's peak GPU memory.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentrl.envs import Env, StepResult
from agentrl.recipe import DefaultRecipe, Evals, History, Prepared, plot_run, print_summary, summary_rows
from agentrl.rewards import RewardResult, register_verifier
from agentrl.run_config import RunConfig
from agentrl.types import Trajectory

BYTES_PER_PARAM = {"bfloat16": 2, "float16": 2, "float32": 4}


class ScaleSection(BaseModel):
    """The ``scale`` section of the run config."""

    model_config = ConfigDict(extra="forbid")

    shape: str = Field(
        "tiny", description="the random model's shape: tiny, tiny-moe, or a full-size one (qwen2.5-7b, ...)"
    )
    num_layers: int | None = Field(
        None,
        ge=1,
        description="the full-size shape with this many of its decoder layers (None: all of them): the "
        "same layers, fewer of them, where the whole model does not fit the machine",
    )
    dtype: str = Field("bfloat16", description="the random model's dtype on disk: bfloat16, float16, float32")
    device: str = Field("cpu", description="where its weights are drawn (cuda: a 7B model in seconds)")
    cache_dir: str = Field(".cache/scale", description="where the random models are kept, by shape and dtype")
    prompt_tokens: int = Field(512, ge=8, description="about how many tokens a task's prompt has")
    num_tasks: int = Field(512, ge=1, description="training tasks (the dataset cycles through them)")
    peak_tflops: float = Field(989.0, gt=0, description="one GPU's dense peak for the MFU (H200 BF16: 989)")

    @field_validator("shape")
    @classmethod
    def _known_shape(cls, value: str) -> str:
        from agentrl.models.random_weights import shape_names

        if value not in shape_names():
            raise ValueError(f"unknown shape {value!r}; choose one of {', '.join(shape_names())}")
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in BYTES_PER_PARAM:
            raise ValueError(f"dtype {value!r}: choose one of {', '.join(BYTES_PER_PARAM)}")
        return value


class ScaleConfig(RunConfig):
    """The generic run config plus the ``scale`` section."""

    scale: ScaleSection = Field(default_factory=ScaleSection, description="the random model and its tasks")


@register_verifier("letter_share")
async def letter_share(trajectory: Trajectory, label: Any) -> RewardResult:
    """The share of the response's visible (non-space) characters that are letters; 0 for an empty one."""
    chars = [c for c in trajectory.assistant_text() if not c.isspace()]
    share = sum(c.isalpha() for c in chars) / len(chars) if chars else 0.0
    return RewardResult(reward=share, parts={"visible": float(bool(chars))})


class ScaleEnv(Env):
    """One turn: the task's prompt, the model's response, done (``letter_share`` scores it)."""

    verifier = "letter_share"

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        return StepResult(terminated=True)


def make_tasks(tokenizer: Any, n: int, prompt_tokens: int, seed: int) -> list[dict[str, Any]]:
    """``n`` tasks, each a prompt of ``prompt_tokens`` random words of ``tokenizer``'s vocabulary: tokens
    that decode to a space and letters, each of which encodes back to itself, so a prompt is that many
    tokens before the chat template wraps it (any non-special token when the vocabulary has few words)."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    words = [w for i in ids if re.fullmatch(r" [A-Za-z]+", w := tokenizer.decode([i]))]
    pool = words if len(words) >= 16 else [tokenizer.decode([i]) for i in ids]
    rng = random.Random(seed)
    return [
        {"id": f"scale-{k}", "prompt": "".join(rng.choices(pool, k=prompt_tokens)).strip(), "label": ""}
        for k in range(n)
    ]


class ScaleRecipe(DefaultRecipe):
    """The random model (or ``model_path``'s), random prompts, the step's costs in the summary."""

    config = ScaleConfig
    model_dir: Path

    def prepare(self) -> Prepared:
        from transformers import AutoTokenizer

        from agentrl.models.pretrained import resolve_model_path

        s = self.cfg.scale
        path = self.cfg.model_path
        self.model_dir = self._build() if path in (None, "auto") else Path(resolve_model_path(path))
        tok = AutoTokenizer.from_pretrained(self.model_dir)
        tasks = make_tasks(tok, s.num_tasks, s.prompt_tokens, self.cfg.seed)
        return Prepared(str(self.model_dir), tasks, [])

    def _build(self) -> Path:
        """The random model of ``scale.shape`` in ``scale.dtype``, built once (a ``DONE`` file marks it)."""
        from agentrl.models.random_weights import build_shape_model

        s = self.cfg.scale
        layers = "" if s.num_layers is None else f"-{s.num_layers}layers"
        out = Path(s.cache_dir) / f"{s.shape}{layers}-{s.dtype}"
        if not (out / "DONE").is_file():
            print(f"scale: building a random {s.shape} model ({s.dtype}, on {s.device}) in {out}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            build_shape_model(s.shape, out, s.dtype, s.device, s.num_layers)
            (out / "DONE").write_text(json.dumps(s.model_dump(include={"shape", "num_layers", "dtype"})))
        return out

    def finish(self, result: dict[str, Any], history: History, evals: Evals) -> dict[str, Any]:
        """The generic summary, then the step's costs (:func:`step_costs`), also saved as ``scale``."""
        out = Path(self.cfg.output_dir)
        plot_run(history, evals, out / "reward.png")
        rows = summary_rows(result, history, out, "reward.png")
        costs = step_costs(self.cfg, history, self.model_dir)
        print_summary(rows + [(COST_LABELS[k], _show(v)) for k, v in costs.items()])
        return {**result, "scale": costs}


# how the summary table names each figure of :func:`step_costs` (means over the steps after the first)
COST_LABELS = {
    "params_b": "parameters (B)",
    "active_params_b": "active parameters a token (B)",
    "step_s": "step (s)",
    "wait_batch_s": "waiting for the batch (s)",
    "train_s": "training (s)",
    "sync_s": "hand-over and weight sync (s)",
    "weight_sync_s": "weight sync (s)",
    "weight_sync_gb_per_s": "weight sync (GB/s)",
    "response_tokens_mean": "response tokens (mean)",
    "generated_tokens_per_s": "generated tokens/s",
    "generated_tokens_per_s_per_gpu": "generated tokens/s per engine GPU",
    "trainer_tokens_per_s": "trainer tokens/s",
    "trainer_tokens_per_s_per_gpu": "trainer tokens/s per trainer GPU",
    "mfu": "trainer MFU (update)",
    "peak_trainer_gpu_mem_gb": "trainer peak GPU memory (GiB)",
}


def _show(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.4g}"


def step_costs(cfg: ScaleConfig, history: History, model_dir: Path) -> dict[str, float]:
    """The figures the module docstring lists, means over the logged steps after the first."""
    from agentrl.models.random_weights import parameter_counts
    from agentrl.run_checks import engine_on_gpu, engine_tp, trainer_on_gpu

    steps = [r for r in history if "time/step_s" in r]
    steps = steps[1:] or steps  # the first step compiles, allocates and warms the caches

    def mean(key: str) -> float:
        values = [r[key] for r in steps if key in r]
        return sum(values) / len(values) if values else float("nan")

    total, active = parameter_counts(model_dir) if model_dir.is_dir() else (0, 0)
    # GPUs, not Ray's GPU shares: colocated, an engine and a trainer rank each reserve half of one GPU
    engine_gpus = cfg.engine.num_engines * engine_tp(cfg) if engine_on_gpu(cfg) else 0
    trainer_gpus = cfg.trainer_world_size if trainer_on_gpu(cfg) else 0
    trainer_tps = mean("trainer/tokens_per_s")
    sync_s = mean("time/weight_sync_s")
    model_gb = total * BYTES_PER_PARAM[cfg.trainer.dtype] / 1e9  # the weights as the trainer sends them
    peaks = [r["trainer/peak_gpu_mem_gb"] for r in steps if "trainer/peak_gpu_mem_gb" in r]
    peak = cfg.scale.peak_tflops * 1e12
    return {
        "params_b": total / 1e9,
        "active_params_b": active / 1e9,
        "step_s": mean("time/step_s"),
        "wait_batch_s": mean("time/wait_batch_s"),
        "train_s": mean("time/train_s"),
        "sync_s": mean("time/sync_s"),
        "weight_sync_s": sync_s,
        "weight_sync_gb_per_s": model_gb / sync_s if sync_s > 0 else float("nan"),
        "response_tokens_mean": mean("batch/response_tokens"),
        "generated_tokens_per_s": mean("rollout/model_tokens_per_s"),
        "generated_tokens_per_s_per_gpu": mean("rollout/model_tokens_per_s") / engine_gpus
        if engine_gpus
        else float("nan"),
        "trainer_tokens_per_s": trainer_tps,
        "trainer_tokens_per_s_per_gpu": trainer_tps / trainer_gpus if trainer_gpus else float("nan"),
        "mfu": 6 * active * trainer_tps / (trainer_gpus * peak) if trainer_gpus else float("nan"),
        "peak_trainer_gpu_mem_gb": max(peaks, default=float("nan")),
    }
