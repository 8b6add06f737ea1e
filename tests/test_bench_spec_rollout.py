"""bench/spec_rollout.py on the CPU: Search-R1 episodes (a tiny model, a small world, the /retrieve server)
played on a plain and then a speculating embedded server; on batch-invariant servers speculation changes
no token, so both play the same episodes, and the line carries both servers' figures and the drafts'
account."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _rounding import ratio_of_rounded

from agentrl.examples.search_r1.world import generate_world
from agentrl.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, "bench/spec_rollout.py"]
SPEC = (
    "--speculative ngram --spec-k 3 --spec-ngram 2 --spec-min-ngram 1 --spec-always --spec-shared-tokens 99"
)


@pytest.fixture(scope="module")
def policy_and_world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("spec-rollout")
    generate_world(seed=0, num_entities=60).write(tmp / "world")
    return build_tiny_model(tmp / "model", arch="qwen2"), tmp / "world"


def test_both_servers_play_the_same_episodes_and_report_the_drafts(
    policy_and_world: tuple[Path, Path],
) -> None:
    model, world = policy_and_world
    args = [
        "--model",
        str(model),
        "--world",
        str(world),
        "--concurrency",
        "2",
        "--tasks",
        "2",
        "--group",
        "2",
    ]
    args += ["--warmup-tasks", "1", "--server-args=--batch-invariant", f"--spec-args={SPEC}"]
    proc = subprocess.run([*BENCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    out = json.loads(lines[0])
    assert out["bench"] == "spec_rollout" and out["policy"] == "model"
    row = out["results"]["2"]
    plain, spec = row["plain"], row["spec"]
    assert plain["episodes"] == spec["episodes"] == 4 and plain["failed"] == spec["failed"] == 0
    assert row["same_tokens"] == 1.0  # exact acceptance on batch-invariant servers: the same tokens
    assert plain["generated_tokens"] == spec["generated_tokens"] > 0
    assert plain["turns_per_episode"] == spec["turns_per_episode"] >= 1
    assert ratio_of_rounded(row["ratio_spec_over_plain"], spec["tok_s"], plain["tok_s"]), row
    # decode and verify steps emit all but each turn's first token (its prefill's)
    for server in (plain, spec):
        steps = server["engine_time"]
        stepping = (steps["decode_busy_frac"] + steps.get("verify_busy_frac", 0.0)) * server["wall_s"]
        made = server["generated_tokens"] - round(server["turns_per_episode"] * server["episodes"])
        assert abs(server["decode_tok_s"] - made / stepping) <= 0.02 * server["decode_tok_s"] + 0.5
    assert ratio_of_rounded(
        row["decode_ratio_spec_over_plain"], spec["decode_tok_s"], plain["decode_tok_s"]
    ), row
    assert "verify_steps" not in plain["engine_time"]  # the plain server does not speculate
    drafts = spec["engine_time"]
    assert drafts["verify_steps"] > 0 and drafts["draft_tokens"] >= drafts["accepted_tokens"]
    assert drafts["accepted_per_verify_row"] == round(drafts["accepted_tokens"] / drafts["verify_rows"], 3)


def test_a_bad_concurrency_is_refused_before_anything_starts() -> None:
    proc = subprocess.run(
        [*BENCH, "--concurrency", "64,x"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "--concurrency: comma-separated integers" in proc.stderr, proc.stderr


def test_a_config_of_another_recipe_is_refused_before_anything_starts() -> None:
    args = [*BENCH, "--config", "examples/scale/config.yaml"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "not a Search-R1 config" in proc.stderr, proc.stderr[-2000:]
