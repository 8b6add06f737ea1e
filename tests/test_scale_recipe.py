"""The scale recipe (examples/scale): random models of a named shape, random-prompt tasks whose reward is a
property of the sampled tokens, and a run whose summary gives what each part of a step costs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentrl.episodes import read_dump
from agentrl.examples.scale.recipe import ScaleSection, letter_share, make_tasks
from agentrl.models.random_weights import build_shape_model, parameter_counts
from agentrl.recipe import load_run_config
from agentrl.types import Trajectory, Turn

ROOT = Path(__file__).resolve().parents[1]


def _trajectory(text: str) -> Trajectory:
    return Trajectory(task_id="t", group_id="g", prompt_ids=[1], turns=[Turn("assistant", 0, 0, text)])


def test_letter_share_scores_the_visible_characters() -> None:
    assert asyncio.run(letter_share(_trajectory("ab c1"), "")).reward == pytest.approx(0.75)
    assert asyncio.run(letter_share(_trajectory("12 !"), "")).reward == 0.0
    empty = asyncio.run(letter_share(_trajectory("  "), ""))
    assert empty.reward == 0.0 and empty.parts == {"visible": 0.0}


def test_random_models_count_their_active_parameters(tmp_path: Path) -> None:
    """A dense model's token uses every parameter; an MoE model's only its k of each layer's experts."""
    dense = build_shape_model("tiny", tmp_path / "dense", "float32")
    total, active = parameter_counts(dense)
    assert total > 0 and active == total
    moe = build_shape_model("tiny-moe", tmp_path / "moe", "float32")
    total, active = parameter_counts(moe)
    cfg = json.loads((moe / "config.json").read_text())
    assert (cfg.get("num_experts") or cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (8, 2)
    assert 0 < active < total
    with pytest.raises(ValueError, match="unknown shape 'qwen9'"):
        build_shape_model("qwen9", tmp_path / "nope")


def test_a_llama_shape_has_its_models_parameter_count(tmp_path: Path) -> None:
    """SmolLM2-135M's shape (a Llama, the LM head tied to the embedding): its model card's 134.5M."""
    model = build_shape_model("smollm2-135m", tmp_path / "smol", "bfloat16")
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"]
    assert parameter_counts(model) == (134_515_008, 134_515_008)


def test_a_shape_cut_to_fewer_layers_keeps_its_layers(tmp_path: Path) -> None:
    """``num_layers``: the Qwen3-MoE shape's own layers, two of them: each layer's attention (q/k norms
    included), router and 16 experts of width 768, the tied embedding and the final norm."""
    model = build_shape_model("qwen3-moe-1b", tmp_path / "moe2", "bfloat16", num_layers=2)
    cfg = json.loads((model / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["moe_intermediate_size"]) == (2, 1024, 768)
    h, q, kv, d = 1024, 16 * 64, 4 * 64, 64
    attention = h * q + 2 * h * kv + q * h + 2 * d + 2 * h
    experts, active = 16 * 3 * h * 768, 2 * 3 * h * 768
    embedding = 151_936 * h
    total = embedding + 2 * (attention + 16 * h + experts) + h
    assert parameter_counts(model) == (total, total - 2 * (experts - active))


def test_tasks_have_prompts_of_about_the_asked_length(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_shape_model("tiny", tmp_path / "m", "float32"))
    tasks = make_tasks(tok, 8, 128, seed=0)
    assert len({t["prompt"] for t in tasks}) == 8 and len({t["id"] for t in tasks}) == 8
    lengths = [len(tok(t["prompt"], add_special_tokens=False)["input_ids"]) for t in tasks]
    assert all(120 <= n <= 136 for n in lengths), lengths
    assert make_tasks(tok, 8, 128, seed=0) == tasks


def test_scale_section_names_a_bad_field() -> None:
    with pytest.raises(ValidationError, match=r"unknown shape 'qwen2\.5-8b'"):
        ScaleSection(shape="qwen2.5-8b")
    with pytest.raises(ValidationError, match="dtype 'int8'"):
        ScaleSection(dtype="int8")


@pytest.mark.parametrize(
    "name",
    [
        "config.yaml",
        "config_7b.yaml",
        "config_7b_disaggregated.yaml",
        "config_7b_2gpu.yaml",
        "config_7b_2gpu_disaggregated.yaml",
        "config_30b_a3b.yaml",
        "config_moe_2gpu.yaml",
    ],
)
def test_scale_configs_load(name: str) -> None:
    """Every scale config validates (the GPU ones as far as a config can be checked without GPUs)."""
    cfg = load_run_config(ROOT / "examples" / "scale" / name)
    assert cfg.env.name == "agentrl.examples.scale.recipe:ScaleEnv"
    assert not cfg.checkpoint.at_end


@pytest.mark.parametrize(
    ("name", "engine_gpus", "trainer_gpus"),
    [
        ("config_7b.yaml", 4, 4),
        ("config_7b_disaggregated.yaml", 2, 2),
        ("config_7b_2gpu.yaml", 2, 2),
        ("config_7b_2gpu_disaggregated.yaml", 1, 1),
        ("config_30b_a3b.yaml", 4, 4),
        ("config_moe_2gpu.yaml", 2, 2),
    ],
)
def test_step_costs_count_gpus_not_ray_shares(
    tmp_path: Path, name: str, engine_gpus: int, trainer_gpus: int
) -> None:
    """Per-GPU figures divide by the GPUs the engines and trainer ranks run on (colocated, each reserves
    half a GPU from Ray: the shares would count half); the first step is left out, the peak memory is the
    largest, the synced bytes are the weights in the trainer's dtype."""
    from agentrl.examples.scale.recipe import step_costs

    cfg = load_run_config(ROOT / "examples" / "scale" / name)
    model = build_shape_model("tiny", tmp_path / "m", "float32")
    total, active = parameter_counts(model)
    first = {"time/step_s": 99.0, "rollout/model_tokens_per_s": 1.0, "trainer/tokens_per_s": 1.0}
    step = {
        "time/step_s": 10.0,
        "time/weight_sync_s": 0.5,
        "rollout/model_tokens_per_s": 8000.0,
        "trainer/tokens_per_s": 4000.0,
    }
    later = [{**step, "trainer/peak_gpu_mem_gb": peak} for peak in (30.0, 40.0)]
    costs = step_costs(cfg, [first, *later], model)
    assert costs["step_s"] == 10.0
    assert costs["generated_tokens_per_s_per_gpu"] == pytest.approx(8000.0 / engine_gpus)
    assert costs["trainer_tokens_per_s_per_gpu"] == pytest.approx(4000.0 / trainer_gpus)
    assert costs["mfu"] == pytest.approx(6 * active * 4000.0 / (trainer_gpus * 989e12))
    assert costs["weight_sync_gb_per_s"] == pytest.approx(total * 2 / 1e9 / 0.5)  # bfloat16
    assert costs["peak_trainer_gpu_mem_gb"] == 40.0


def test_scale_run_reports_the_step_costs(tmp_path: Path) -> None:
    """Three steps of the tiny shape on the CPU: rewards vary within groups, the summary carries the step's
    parts, token rates and weight-sync bandwidth, and no checkpoint is written at the end."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    cmd = [
        sys.executable,
        "train_async.py",
        "--config",
        "examples/scale/config.yaml",
        f"output_dir={out}",
        f"scale.cache_dir={cache}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    costs = summary["scale"]
    total, _ = parameter_counts(cache / "tiny-float32")
    assert costs["params_b"] == pytest.approx(total / 1e9) and costs["active_params_b"] == costs["params_b"]
    for key in ("step_s", "train_s", "weight_sync_s", "weight_sync_gb_per_s", "generated_tokens_per_s"):
        assert costs[key] > 0, key
    assert costs["trainer_tokens_per_s"] > 0
    assert 0 < costs["response_tokens_mean"] <= 32
    assert "weight sync (GB/s)" in proc.stdout and "generated tokens/s" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["batch/reward"] for r in rows if "batch/reward" in r]
    assert len(rewards) == 3 and all(0 < r < 1 for r in rewards)
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


# the 4-GPU configs' layouts with the CPU and the small shapes: embedded engines, float32, a few tokens
_ON_THE_CPU = (
    "steps=2 scale.dtype=float32 scale.device=cpu scale.prompt_tokens=64 scale.num_tasks=64 "
    "engine.backend=embedded engine.device=cpu engine.dtype=float32 engine.gpus_per_engine=0 "
    "trainer.device=cpu trainer.dtype=float32 rollout.batch_size=4 rollout.group_size=4 "
    "rollout.max_concurrency=32 rollout.max_total_tokens=512 rollout.sampling.max_new_tokens=32 "
    "ray.num_cpus=5 rollout.dump=true"
).split()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "shape", "layout"),
    [
        ("config_7b.yaml", "tiny", "engines [0, 1, 2, 3], trainer ranks [0, 1, 2, 3]"),
        ("config_7b_disaggregated.yaml", "tiny", "engines [0, 1], trainer ranks [0, 1]"),
        ("config_30b_a3b.yaml", "tiny-moe", "engines [0], trainer ranks [0, 1, 2, 3]"),
    ],
)
def test_the_four_gpu_layouts_train_on_the_cpu(tmp_path: Path, name: str, shape: str, layout: str) -> None:
    """Each 4-GPU config's layout as it is (colocated TP2 x DP2 with four engines and the weights in
    memory; two engines beside a TP2 trainer with a broadcast; EP4 with CPU Adam and routing replay), on
    the CPU with the small shape of its kind: two steps that train, every rank and engine placed."""
    out = tmp_path / "run"
    cmd = [sys.executable, "train_async.py", "--config", f"examples/scale/{name}", f"output_dir={out}"]
    cmd += [*_ON_THE_CPU, f"scale.shape={shape}", f"scale.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert layout in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "policy_version" in r]
    assert [r["policy_version"] for r in train] == [1, 2]
    assert all(r["trainer/grad_norm"] > 0 for r in train)
    assert json.loads((out / "summary.json").read_text())["scale"]["weight_sync_s"] > 0
    # a group's samples, spread over the engines, are draws of their own (32 tokens of a random model
    # at temperature 1: two alike would be a shared seed, never chance)
    groups: dict[str, set[tuple[int, ...]]] = {}
    for record in read_dump(out / "trajectories" / "step_000001.jsonl.gz"):
        if record["kind"] == "train":
            groups.setdefault(record["group_id"], set()).add(tuple(record["response_ids"]))
    assert len(groups) == 4 and all(len(samples) == 4 for samples in groups.values()), groups
