"""End to end with fp8 rollout: ``python train_async.py ... engine.quantization=fp8`` on the CI-sized
Search-R1 config starts its engine with fp8 projections, trains with TIS over the engine's logprobs, and
the engine's log says what it served."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train_async_e2e import CONFIG, _left_after, _leftovers, _run

from agentrl.metrics import read_metrics


@pytest.mark.slow
def test_train_async_with_fp8_rollout(tmp_path: Path, search_r1_cache: Path) -> None:
    assert not _leftovers(), "processes from an earlier test are still running"
    cfg = tmp_path / "e2e.yaml"
    out = tmp_path / "run"
    cfg.write_text(CONFIG.format(out=out, cache=search_r1_cache))
    _run(["--config", str(cfg), "steps=2", "eval.num_tasks=2", "engine.quantization=fp8"])
    assert "float32, fp8 projections" in (out / "engine_0.log").read_text()
    train = [r for r in read_metrics(out / "metrics.jsonl") if "policy_version" in r]
    assert [r["policy_version"] for r in train] == [1, 2]
    # the engine's fp8 logprobs differ from the trainer's fp32 ones on the same weights: TIS has work
    same = [r for r in train if r["trainer/same_version_token_frac"] > 0]
    assert same and all(r["trainer/mismatch_logprob_abs_diff_max_same_version"] > 1e-4 for r in same)
    assert not _left_after(), "the run left processes behind"
