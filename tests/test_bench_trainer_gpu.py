"""bench/trainer_gpu.py's data-parallel run on the CPU: ``--world-size 2`` trains the same batches again on
two gloo processes after the one-process run, keeps the one-process keys, and reports the two-rank figures
beside them; data parallel splits the batch, so the two runs' gradients agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_world_size_2_reports_beside_the_one_process_run() -> None:
    args = ["--device", "cpu", "--skip-sync", "--skip-baseline", "--world-size", "2", "--steps", "1"]
    proc = subprocess.run(
        [sys.executable, "bench/trainer_gpu.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = "bench shape params batch seq_len update_tokens_per_s step_tokens_per_s step_s grad_norm"
    for key in [*keys.split(), "model_tflops_per_s"]:
        assert key in out, key
    par = out["parallel"]
    assert (par["world_size"], par["tp"], par["dp"]) == (2, 1, 2)
    assert par["step_tokens_per_s"] == pytest.approx(out["batch"] * out["seq_len"] / par["step_s"])
    assert out["parallel_over_one_gpu"] == pytest.approx(par["step_tokens_per_s"] / out["step_tokens_per_s"])
    assert par["trained_tokens"] == out["trained_tokens"] > 0  # each rank trained its half of the batch
    # same initial weights and batches: the two ranks' gradient (averaged over the data-parallel group) is
    # the one process's, so both runs took the same steps
    assert par["grad_norm"] == pytest.approx(out["grad_norm"], rel=1e-5)


def test_tp_must_divide_the_world_size() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/trainer_gpu.py", "--world-size", "3", "--tp", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--world-size 3 is not a multiple of --tp 2" in proc.stderr
