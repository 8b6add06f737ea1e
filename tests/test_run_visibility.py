"""What the driver's console and metrics show: the first error of each failure kind with its count,
``reward/<part>``, a progress line that says which reward it shows; what verifiers read of a trajectory."""

from __future__ import annotations

import io
import json

import pytest

from agentrl.metrics import ProgressLine, batch_metrics
from agentrl.rollout.metrics import RolloutMetrics
from agentrl.rollout.shards import merge_stats
from agentrl.types import ToolCallRecord, Trajectory


def _failing_episode(m: RolloutMetrics, kind: str, error: Exception) -> None:
    try:
        raise error
    except Exception:
        m.failure(kind)  # as the episode runner counts it, inside its except block


def test_the_first_error_of_each_kind_rides_in_the_snapshot() -> None:
    m = RolloutMetrics()
    _failing_episode(m, "env", ValueError("unknown unit 'furlong'"))
    _failing_episode(m, "env", ValueError("a later one"))
    m.failure("verifier", "verifier exact_match failed: KeyError: 'label'")
    m.failure("internal")  # no text: the count alone
    snap = m.snapshot()
    assert snap["rollout/failures/env"] == 2
    assert snap["rollout/first_error/env"] == "env: ValueError: unknown unit 'furlong'"
    assert snap["rollout/first_error/verifier"].startswith("verifier exact_match failed")
    assert "rollout/first_error/internal" not in snap
    # shards' figures are summed: the text stays the first shard's, the counts add up
    other = RolloutMetrics()
    _failing_episode(other, "env", ValueError("shard two"))
    merged = merge_stats([snap, other.snapshot()])
    assert merged["rollout/failures/env"] == 3
    assert merged["rollout/first_error/env"] == "env: ValueError: unknown unit 'furlong'"
    restored = RolloutMetrics()
    restored.load_state_dict(m.state_dict())  # a resumed run keeps the texts
    assert restored.snapshot()["rollout/first_error/env"] == snap["rollout/first_error/env"]


def test_progress_line_prints_each_first_error_once_and_shows_the_training_reward() -> None:
    out = io.StringIO()
    line = ProgressLine(10, {"train_reward": "batch/reward"}, stream=out)
    m = RolloutMetrics()
    _failing_episode(m, "env", ValueError("unknown unit 'furlong'"))
    held_out = (0, {"eval/reward": 0.25})
    first = line.update(1, {"batch/reward": 0.5, **m.snapshot()}, held_out=held_out)
    _failing_episode(m, "env", ValueError("again"))
    second = line.update(2, {"batch/reward": 0.75, **m.snapshot()}, held_out=held_out)
    text = out.getvalue()
    assert text.count("rollout: 1 env failure(s) so far; the first: env: ValueError: unknown unit") == 1
    assert "train_reward=0.5 | held-out@0 reward=0.25 | train_failed=1" in first
    assert "train_reward=0.75 | held-out@0 reward=0.25 | train_failed=2" in second  # the batch's, each step


def test_reward_parts_are_batch_metrics() -> None:
    trajs = [Trajectory(task_id=str(i), group_id="g", prompt_ids=[0]) for i in range(3)]
    for t, (reward, parts) in zip(
        trajs, [(1.0, {"format": 1.0, "tool": 1.0}), (0.0, {"format": 0.5}), (0.5, {})], strict=True
    ):
        t.reward, t.reward_parts = reward, parts
    figures = batch_metrics(trajs, 0)
    assert figures["batch/reward"] == 0.5
    assert figures["reward/format"] == 0.75 and figures["reward/tool"] == 1.0


def test_verifiers_read_the_final_answer_and_the_tool_results() -> None:
    t = Trajectory(task_id="t", group_id="g", prompt_ids=[0])
    t.append_model_tokens([1], [0.0], 0, text="<tool_call>...</tool_call>")
    t.turns[-1].tool_calls = [
        ToolCallRecord(None, error="not JSON"),  # a call that did not parse: nothing ran
        ToolCallRecord("convert", {"value": 3, "unit": "ft"}, result="0.9144 m", latency_s=0.01),
        ToolCallRecord("python", {"code": "1/0"}, error="ZeroDivisionError"),
    ]
    t.append_observation_tokens([2], text="0.9144 m")
    assert t.final_answer is None  # the episode so far ends on a tool call
    t.append_model_tokens([3], [0.0], 0, text="0.9144")
    assert t.final_answer == "0.9144"
    assert [c.name for c in t.tool_results()] == ["convert", "python"]
    assert [c.result for c in t.tool_results("convert")] == ["0.9144 m"]
    t.info["answer"] = "0.91"  # an env that parsed the answer out of the last turn
    assert t.final_answer == "0.91"
    assert Trajectory.from_json(t.to_json()).tool_results()[0].arguments == {"value": 3, "unit": "ft"}


def test_the_metrics_of_a_live_run_read_as_whole_rows(tmp_path) -> None:
    from agentrl.metrics import MetricsLogger, read_metrics

    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log({"a": 1.0, "text": "x" * 20_000}, 1)  # a row longer than any write buffer
    logger.log({"a": 2.0}, 2)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3.0, "a": ')  # a row the run is still writing
    assert [r["a"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 2.0]
    logger.close()
    logger.close()  # idempotent


def test_tensorboard_gets_every_numeric_metric_without_torch(tmp_path) -> None:
    """The scalars reach TensorBoard's event files, one per metric and step with the row's time, and the
    logger loads no torch for them (the driver imports none for its metrics)."""
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    code = (
        "import sys\n"
        "from agentrl.metrics import MetricsLogger\n"
        f"logger = MetricsLogger({str(tmp_path)!r})\n"
        "assert logger.tensorboard_enabled\n"
        "logger.log({'reward/mean': 0.25, 'time/step_s': 1.5}, 1)\n"
        "logger.log({'reward/mean': 0.5}, 2)\n"
        "logger.close()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["reward/mean", "time/step_s"]
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("time/step_s")] == [(1, 1.5)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert events.Scalars("reward/mean")[0].wall_time == pytest.approx(rows[0]["time"])
