"""bench/engine_throughput.py on the CPU (the tiny model): the fp8 A/B (``--quantizations none,fp8``) serves
the same rounds unquantized and in fp8 (the quantize-dequantize arithmetic on a CPU), one server after the
other, and prints one JSON line with both modes' tokens/s, their ratio and the fp8 server's quantization
seconds at load and after a weight update."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _rounding import ratio_of_rounded

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, "bench/engine_throughput.py"]


def test_fp8_ab_reports_both_modes_their_ratio_and_the_quantization_time() -> None:
    args = ["--concurrency", "1,2", "--prompt-len", "8", "--max-new-tokens", "4", "--no-hf"]
    proc = subprocess.run(
        [*BENCH, *args, "--quantizations", "none,fp8"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    out = json.loads(lines[0])
    assert out["bench"] == "engine_throughput" and out["quantizations"] == ["none", "fp8"]
    assert out["params_m"] > 0
    for c in ("1", "2"):
        row = out["results"][c]
        assert row["requests"] == 2 * int(c)
        assert row["engine_tok_s"] > 0 and row["fp8_tok_s"] > 0
        assert ratio_of_rounded(row["ratio_fp8_over_unquantized"], row["fp8_tok_s"], row["engine_tok_s"]), row
        spent = row["engine_time"]  # the unquantized server's own account of the round
        assert spent["decode_steps"] >= 4 and 1 <= spent["rows_per_decode_step"] <= int(c)
        assert 0 < spent["decode_busy_frac"] <= spent["device_busy_frac"] <= 1.05
        assert 0 < spent["decode_device_ms_per_step"] <= spent["wall_ms_per_decode_step"]
    fp8 = out["fp8"]
    assert fp8["quantize_load_s"] > 0 and fp8["quantize_update_s"] > 0
    # the update reads the checkpoint from disk, then quantizes
    assert fp8["update_wall_s"] >= fp8["quantize_update_s"]
    assert fp8["context_len"] > 0


def test_an_unknown_quantization_list_is_refused_before_anything_starts() -> None:
    proc = subprocess.run(
        [*BENCH, "--quantizations", "fp8"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "--quantizations: none, or none,fp8" in proc.stderr, proc.stderr[-2000:]


def test_speculative_ab_reports_both_servers_and_the_drafts_account() -> None:
    """``--speculative``: the same rounds and episodes without and then with speculative decoding, the
    ratio, and the speculating server's verify steps, skipped steps, drafted and accepted tokens."""
    args = [
        "--concurrency",
        "2",
        "--prompt-len",
        "8",
        "--max-new-tokens",
        "8",
        "--no-hf",
        "--multi-turn",
        "2",
    ]
    spec = "--speculative ngram --spec-k 3 --spec-ngram 2 --spec-min-ngram 1 --spec-always"
    proc = subprocess.run(
        [*BENCH, *args, "--obs-len", "8", "--speculative", "--spec-args", spec],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    row = out["results"]["2"]
    assert row["engine_tok_s"] > 0 and row["spec_tok_s"] > 0
    assert ratio_of_rounded(row["ratio_spec_over_plain"], row["spec_tok_s"], row["engine_tok_s"]), row
    assert "verify_steps" not in row["engine_time"]  # the plain server does not speculate
    for account in (row["spec_time"], out["multi_turn_spec"]["spec"]):
        assert 0 <= account["accepted_tokens"] <= account["draft_tokens"]
        assert account["verify_steps"] <= account["verify_rows"]
        assert account["skipped_steps"] == 0  # --spec-always: no gate, every step with a draft verifies
    assert out["spec_args"] == spec and out["multi_turn_spec"]["episodes"] == 2


def test_split_times_the_prefill_and_a_decode_step_apart() -> None:
    """``--split``: a round of one new token first (the prompts' prefill), then the round, which finds
    the prompts cached: its seconds over 2 x max-new-tokens steps are the decode step."""
    args = ["--concurrency", "1,3", "--prompt-len", "16", "--max-new-tokens", "6", "--no-hf", "--split"]
    proc = subprocess.run([*BENCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for c in (1, 3):
        row = out["results"][str(c)]
        split = row["engine_split"]
        assert split["prefill_s"] > 0
        # the round made 2C x 6 tokens in 2 x 6 steps: a step is C tokens at the round's rate
        assert split["decode_step_ms"] == pytest.approx(c * 1000 / row["engine_tok_s"], rel=0.01)
        assert "sglang_split" not in row  # only the engines that served the rounds
