"""The custom tool env example (examples/custom_tool_env): its env, verifier and expert demonstrations, and
its first RL run through the real main job, warm start included, which must make tool calls."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.envs import check_env
from agentrl.episodes import read_dump
from agentrl.examples.custom_tool_env.demos import expert, make_demos
from agentrl.examples.custom_tool_env.env import UnitConversionEnv, make_tasks, unit_conversion
from agentrl.rewards import RewardResult
from agentrl.types import ToolCallRecord, Trajectory

ROOT = Path(__file__).resolve().parents[1]


def answered(text: str, called: bool = True) -> Trajectory:
    t = Trajectory(task_id="t", group_id="g", prompt_ids=[0])
    t.append_model_tokens([1], [0.0], 0, text="<tool_call>...</tool_call>")
    t.turns[-1].tool_calls = [ToolCallRecord("calculator" if called else None)]
    t.append_observation_tokens([2], "3000")
    t.append_model_tokens([3], [0.0], 0, text=text)
    return t


def test_verifier_gives_partial_credit() -> None:
    def score(text: str, called: bool = True) -> RewardResult:
        return asyncio.run(unit_conversion(answered(text, called), 3000))

    assert score("3000 m") == RewardResult(1.0, {"answered": 1.0, "called_tool": 1.0})
    assert score("2700 m").reward == pytest.approx(0.9)
    assert score("90000 m").reward == 0.0 and score("no idea").parts["answered"] == 0.0
    assert score("3000 m", called=False).parts == {"answered": 1.0, "called_tool": 0.0}


def test_expert_passes_the_checker_and_its_demos_score_full_marks() -> None:
    task = make_tasks(1, seed=3)[0]
    call = expert(task, [{"role": "user", "content": task["prompt"]}])
    assert asyncio.run(check_env(UnitConversionEnv, task, [call, "1 m"])) == []
    demos = make_demos(20, seed=5)
    assert len(demos) == 20 and all(d["tools"][0]["function"]["name"] == "calculator" for d in demos)
    for demo, task in zip(demos, make_tasks(20, seed=5), strict=True):
        t = answered(demo["messages"][-1]["content"])
        assert asyncio.run(unit_conversion(t, task["label"])).reward == 1.0, demo


@pytest.mark.slow
def test_first_rl_run_after_the_warm_start_makes_tool_calls(tmp_path: Path) -> None:
    """The example's config with a lighter warm start (1,000 demonstrations, 150 steps) and one RL step
    (four groups of four): the episodes of the first batch call the calculator in well-formed calls
    (a random model makes none)."""
    out = tmp_path / "run"
    argv = [
        "--config",
        "examples/custom_tool_env/config.yaml",
        f"output_dir={out}",
        f"model_path={tmp_path / 'sft'}",
    ]
    argv += ["demos=1000", "warm_start.steps=150", "steps=1"]
    argv += ["eval.before=false", "eval.after=false", "ray.num_cpus=2"]
    proc = subprocess.run(
        [sys.executable, "train_async.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    sft = json.loads((tmp_path / "sft" / "sft.json").read_text())
    assert sft["sft/final_loss"] < 1.0, sft

    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    episodes = row["rollout/episodes"]
    assert episodes >= 16 and row.get("rollout/episodes_without_tool_calls", 0) <= episodes / 2, row
    trajs = read_dump(out / "trajectories" / "step_000001.jsonl.gz")
    calls = [c for t in trajs for turn in t["turns"] for c in turn["tool_calls"]]
    well_formed = [c for c in calls if c["name"] == "calculator" and c["error"] is None]
    with_call = sum(
        any(c["name"] == "calculator" for turn in t["turns"] for c in turn["tool_calls"]) for t in trajs
    )
    assert with_call >= len(trajs) / 2 and len(well_formed) >= len(calls) / 2, calls
    assert row["batch/tool_call_rate"] >= 0.5  # the recipe's figure of the trained batch
