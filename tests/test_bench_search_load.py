"""The benches of the Search-R1 rollout's two shared services on the CPU, kept small: the retrieval
server of 1 and 2 workers (bench/retrieval.py --workers), and the rollout's event loop against the
retrieval server (bench/search_rollout.py); each prints one JSON line of sane figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench(*args: str) -> dict:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_retrieval_bench_compares_one_worker_with_two() -> None:
    out = _bench("bench/retrieval.py", "--workers", "2", "--passages", "600", "--queries", "300")
    c = out["concurrency"]
    assert out["workers"] == 2 and out[f"http_single_c{c}_qps"] > 0 and out[f"w2_http_single_c{c}_qps"] > 0
    assert sum(out["w2_requests_per_worker"]) == sum(out["requests_per_worker"]) > 0
    assert len(out["w2_requests_per_worker"]) == 2 and len(out["requests_per_worker"]) == 1
    assert 0 < out["server_busy_frac"] <= 1.5 and 0 < out["w2_server_busy_frac"] <= 1.5
    ratio = out[f"w2_http_single_c{c}_qps"] / out[f"http_single_c{c}_qps"]
    assert out["ratio_workers2_vs_1_single"] == round(ratio, 3)


def test_search_rollout_bench_reports_the_loop_and_the_server() -> None:
    out = _bench(*"bench/search_rollout.py --concurrency 32 --seconds 1.5 --warmup 1 --entities 150".split())
    for row in (out["workers1"], out["workers2"]):
        assert row["turns_per_s"] > 0 and row["searches_per_s"] > 0 and row["failures"] == 0
        assert 0 < row["loop_busy_frac"] <= 1 and 0 <= row["loop_cpu_frac"] <= 1
        assert row["loop_ms_per_turn"] > 0 and row["loop_lag_ms_p90"] >= 0
        assert 0 < row["server_request_ms_mean"] and 0 < row["server_busy_frac"] <= 1
        assert 0 <= row["server_queue_ms_mean"] <= row["server_request_ms_mean"]
