"""bench/search_r1_scaling.py without GPUs: the runs it plans (their configs valid as a run would load
them), its refusal of a bad override before any run starts, and the figures it reads from a run's
metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "search_r1_scaling.py"
sys.path.insert(0, str(ROOT / "bench"))

import search_r1_scaling as bench  # noqa: E402


def _dry_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )


def test_dry_run_plans_the_baseline_dp_and_disaggregated_runs(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "--gpus", "0,1,2,3", "--disaggregated")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "train_async.py" in line]
    assert len(lines) == 3 and not done.stdout
    one, dp4, split = lines
    assert one.startswith("CUDA_VISIBLE_DEVICES=0 ") and "trainer_world_size" not in one
    assert "engine.mem_fraction=0.2" in one and "engine.mem_fraction=0.2" in dp4
    assert dp4.startswith("CUDA_VISIBLE_DEVICES=0,1,2,3 ")
    for part in ("trainer_world_size=4", "engine.num_engines=4", "rollout.shards=4", "rollout.batch_size=64"):
        assert part in dp4
    for part in ("placement=disaggregated", "weight_sync=distributed", "trainer_world_size=2"):
        assert part in split
    assert "rollout.batch_size=32" in split and "engine.num_engines=2" in split
    assert f"output_dir={tmp_path / 'colocated_dp4'}" in dp4  # each run's output of its own
    assert not any(tmp_path.iterdir())  # a dry run starts nothing and writes nothing


def test_a_bad_override_is_refused_before_any_run(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "--gpus", "0,1", "rollout.group_size=0")
    assert done.returncode != 0
    assert "rollout.group_size" in done.stderr
    assert "train_async.py" not in done.stderr  # refused before the first command


def test_an_earlier_run_in_the_output_is_not_mixed_in(tmp_path: Path) -> None:
    (tmp_path / "colocated_dp2").mkdir()
    done = _dry_run(tmp_path, "--gpus", "0,1")
    assert done.returncode != 0 and "colocated_dp2" in done.stderr and "already there" in done.stderr


def test_one_gpu_plans_the_baseline_alone() -> None:
    runs = bench.plan(["3"], batch=16, group=8, concurrency=256, pool=0.2, disaggregated=True)
    assert [(r.name, r.gpus, r.trajectories) for r in runs] == [("one_gpu", ["3"], 128)]


def _write_run(out: Path, name: str, step_s: list[float], em: float) -> None:
    (out / name).mkdir(parents=True)
    rows = [{"step": 0.0, "eval/exact_match": 0.0}]
    for i, s in enumerate(step_s, start=1):
        rows.append(
            {"step": float(i), "time/step_s": s, "time/sync_s": s / 10, "rollout/loop_busy_frac": 0.5}
        )
    rows.append({"step": float(len(step_s)), "eval/exact_match": em})
    (out / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / name / "summary.json").write_text(json.dumps({"em_after": em, "em_after_se": 0.03}))


def test_figures_leave_out_the_first_step_and_compare_with_one_gpu(tmp_path: Path) -> None:
    runs = bench.plan(["0", "1"], batch=16, group=8, concurrency=256, pool=0.2, disaggregated=False)
    _write_run(tmp_path, "one_gpu", [9.0, 1.0, 1.0], em=0.6)  # the warm-up step is left out
    _write_run(tmp_path, "colocated_dp2", [9.0, 1.5, 1.5], em=0.7)
    results = bench.against_one_gpu({r.name: bench.figures(r, tmp_path, wall_s=10.0) for r in runs})
    one, dp2 = results["one_gpu"], results["colocated_dp2"]
    assert one["trajectories_per_s"] == pytest.approx(128.0)
    assert dp2["trajectories_per_s"] == pytest.approx(256 / 1.5)
    assert dp2["vs_one_gpu"] == pytest.approx(2 / 1.5) and one["vs_one_gpu"] == 1.0
    assert dp2["step_s"] == {"step_s": pytest.approx(1.5), "sync_s": pytest.approx(0.15)}
    assert dp2["rollout_loop_busy_frac"] == 0.5
    assert dp2["em_curve"] == {0: 0.0, 3: 0.7} and dp2["em_after"] == 0.7


def test_a_run_without_steps_is_an_error(tmp_path: Path) -> None:
    run = bench.plan(["0"], 16, 8, 256, 0.2, False)[0]
    _write_run(tmp_path, "one_gpu", [9.0], em=0.0)
    with pytest.raises(RuntimeError, match="no step past the first"):
        bench.figures(run, tmp_path, wall_s=1.0)
