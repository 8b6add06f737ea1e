"""bench/tp_logprobs.py on the CPU: the tiny model in fp32, tp=1 in one process against tp=2 over two gloo
processes. Each side repeats itself bit for bit; the two sides agree to fp32 rounding but not bit for bit,
since a row-parallel linear sums two half-K GEMMs where one rank runs one GEMM over all K (the bench's
docstring), so the check is a tolerance; one train step on each side lands on the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_tp2_logprobs_match_tp1_within_fp32_rounding() -> None:
    args = ["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--tp", "2", "--train-step"]
    proc = subprocess.run(
        [sys.executable, "bench/tp_logprobs.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-3000:]  # ONE JSON line
    out = json.loads(lines[0])
    assert (out["bench"], out["device"], out["gpus"], out["dtype"], out["shape"], out["tp"]) == (
        "tp_logprobs",
        "cpu",
        None,
        "float32",
        "tiny",
        2,
    )
    # every response token of the default batch (8 x 32) is a sampled one
    assert out["tokens_compared"] == out["batch"] * out["response_len"] == 256

    # the noise floor: each side computes the same logprobs twice, bit for bit
    for floor in (out["tp1_vs_tp1"], out["tp_vs_tp"]):
        assert floor == {
            "logprob_abs_diff_max": 0.0,
            "logprob_abs_diff_mean": 0.0,
            "exact_fraction": 1.0,
            "kl_k3": 0.0,
        }
    tp = out["tp_vs_tp1"]
    assert 0.0 <= tp["logprob_abs_diff_mean"] <= tp["logprob_abs_diff_max"] <= 1e-5
    assert 0.0 <= tp["exact_fraction"] <= 1.0
    assert 0.0 <= tp["kl_k3"] <= 1e-10  # k3 ~ d^2 / 2

    step = out["train_step"]
    assert step["loss_tp1"] != 0.0
    assert step["loss_abs_diff"] == abs(step["loss_tp1"] - step["loss_tp"]) <= 1e-5
    # the same update: the weights apart by far less than the step moved them (Adam's first step ~ lr)
    assert 0.0 < step["update_abs_max_tp1"]
    assert step["weights_abs_diff_max"] <= 0.1 * step["update_abs_max_tp1"]

    wall = out["wall_s"]
    assert len(wall["tp1_logprobs"]) == len(wall["tp_logprobs"]) == 2
    assert all(
        t > 0
        for t in [*wall["tp1_logprobs"], *wall["tp_logprobs"], wall["tp1_train_step"], wall["tp_train_step"]]
    )
    assert wall["total"] > max(wall["tp1_logprobs"]) + max(wall["tp_logprobs"])
