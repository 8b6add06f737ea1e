"""bench/lora.py on the CPU (the tiny model): full fine-tuning and LoRA side by side, each in a process of
its own; LoRA trains and syncs a fraction of the parameters, and the engine serves what was pushed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_lora_bench_reports_both_modes_and_the_engine_serves_the_push() -> None:
    # one torch thread in every process (the bench, its two trainers, its engines): the tiny model's ops
    # are too small to share, and with another core busy a team of two waits for its descheduled member at
    # every op, which slows generation tenfold
    proc = subprocess.run(
        [sys.executable, "bench/lora.py", "--engine", "--steps", "1", "--rank", "4"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    full, lora = out["full"], out["lora"]
    assert full["fits"] and lora["fits"]
    assert full["trainable_params"] == full["params"] == lora["params"]
    assert 0 < lora["trainable_params"] < full["params"] / 4
    assert 0 < lora["sync_bytes"] < full["sync_bytes"]
    for mode in (full, lora):  # three syncs, and the engine serves the last one's version
        assert mode["pushed_version"] == 3 and mode["engine_weight_version"] == "3"
        assert mode["step_s"] > 0 and mode["sync_s"] > 0
    assert out["lora_over_full"]["sync_bytes"] == pytest.approx(lora["sync_bytes"] / full["sync_bytes"])
