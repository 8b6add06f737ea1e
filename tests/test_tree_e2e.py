"""Tree rollouts through the real main job: ``python train_async.py`` on the CI-sized Search-R1 config with
``rollout.tree`` on, for two steps. It must train on the trees' leaves, log the tree figures and leave no
process behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.episodes import read_dump, step_path
from agentrl.metrics import read_metrics
from agentrl.testing.configs import TINY_SEARCH_R1

ROOT = Path(__file__).resolve().parent.parent

CONFIG = (
    TINY_SEARCH_R1
    + """output_dir: {out}
steps: 2
engine: {{max_batch_size: 16}}
rollout: {{group_size: 2, batch_size: 2, max_staleness: 1, max_concurrency: 16, max_turns: 3,
          max_total_tokens: 600, sampling: {{temperature: 1.0, max_new_tokens: 24}},
          eval_sampling: {{temperature: 0.0, max_new_tokens: 24}}, verifier: exact_match,
          filter_zero_variance: false, tree: {{branch_at: [1], k: 2}}, dump: all}}
trainer: {{device: cpu, lr: 1.0e-4, micro_batch_size: 8}}
eval: {{num_tasks: 4, before: false}}
checkpoint: {{interval: 0}}
"""
)


@pytest.mark.slow
def test_tree_rollouts_train_log_their_figures_and_clean_up(tmp_path: Path, search_r1_cache: Path) -> None:
    from test_train_async_e2e import _left_after, _leftovers

    assert not _leftovers(), "processes from an earlier test are still running"
    cfg = tmp_path / "tree.yaml"
    out = tmp_path / "run"
    cfg.write_text(CONFIG.format(out=out, cache=search_r1_cache))
    proc = subprocess.run(
        [sys.executable, "train_async.py", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"train_async failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "policy_version" in r]
    assert [r["policy_version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["batch/staleness_max"] <= 1
        # 2 trees a task, each of 2 leaves (one that answers at turn 1 is sampled again); fewer where one
        # fails
        assert 2 <= r["tree/leaves_per_task"] <= 4 and 1 <= r["tree/leaves_per_tree"] <= 2
        assert 0 < r["tree/generated_tokens"] <= r["tree/leaf_model_tokens"]
        assert r["tree/shared_prefix_tokens"] >= 0
        assert r["rollout/tree_leaves"] >= r["rollout/tree_trees"] > 0
        assert 0 <= r["rollout/prefix_cache_hit_rate"] <= 1
    # the dumps hold each leaf's place in its tree
    records = read_dump(step_path(out, 1), kind="train")
    assert records and all(rec["tree"]["tree_id"].startswith(rec["group_id"]) for rec in records)
    assert not _left_after(), "the run left processes behind"
