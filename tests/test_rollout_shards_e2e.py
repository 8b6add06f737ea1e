"""``python train_async.py`` with ``rollout.shards: 2`` on the CI-sized Search-R1 config: two embedded
engines, two orchestrator actors (one engine each), one trainer rank. The run trains, evaluates, checkpoints
the two shards' state and leaves no process behind."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from test_train_async_e2e import CONFIG, _left_after, _leftovers, _run

from agentrl.metrics import read_metrics


@pytest.mark.slow
def test_train_async_with_two_rollout_shards(tmp_path: Path, search_r1_cache: Path) -> None:
    assert not _leftovers(), "processes from an earlier test are still running"
    out = tmp_path / "run"
    text = CONFIG.format(out=out, cache=search_r1_cache)
    text = text.replace("engine: {max_batch_size: 16}", "engine: {max_batch_size: 16, num_engines: 2}")
    text = text.replace("steps: 3", "steps: 2").replace("eval: {num_tasks: 8}", "eval: {num_tasks: 5}")
    cfg = tmp_path / "shards.yaml"
    cfg.write_text(text + "ray: {num_cpus: 4}\n")  # a trainer rank and two rollout shards reserve 3

    stdout = _run(["--config", str(cfg), "rollout.shards=2"])
    assert "held-out exact match before" in stdout and "held-out exact match after" in stdout
    train = [r for r in read_metrics(out / "metrics.jsonl") if "policy_version" in r]
    assert [r["policy_version"] for r in train] == [1, 2]
    assert [r["rollout/trained_groups"] for r in train] == [2, 4]  # batch_size 2: one group of each shard
    for r in train:
        assert r["batch/staleness_max"] <= 1
        busy = [r[f"rollout/shard{i}/loop_busy_frac"] for i in range(2)]
        assert r["rollout/loop_busy_frac"] == max(busy) and all(0 <= b <= 1 for b in busy)
    state = pickle.loads((out / "checkpoints" / "rollout_00000002.pkl").read_bytes())
    assert len(state["shards"]) == 2 and all("cursor" in s for s in state["shards"])
    assert not _left_after(), "the run left processes behind"
