"""The chaos bench, short (``bench/chaos.py --episodes 60``): the embedded engine SIGKILLed and restarted
under in-flight requests, env steps raising, tool calls timing out, sandboxes killed for memory, the
verifier raising, the retrieval server answering 500, weight updates landing mid-generation. Nothing is
lost or trained twice, and every failed attempt carries its error text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_chaos_bench_loses_nothing_and_names_every_failure(tmp_path: Path) -> None:
    failures = tmp_path / "failures.jsonl"
    run = "--episodes 60 --batch-size 2 --clean-episodes 0 --step-timeout 1.5"
    # rates high enough that 60 episodes meet every fault (about 180 env steps, 60 tool calls each)
    faults = "--env-raise 0.05 --tool-timeout 0.05 --verifier-raise 0.15 --retrieval-500 0.5"
    proc = subprocess.run(
        [sys.executable, "bench/chaos.py", *run.split(), "--failures-out", str(failures), *faults.split()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    g, e = r["groups"], r["episodes"]
    # drawn = trained + failed/dropped (by reason) + in flight, for groups and for episodes: nothing lost
    assert g["drawn"] == 15 and g["lost"] == 0 and g["duplicated"] == 0
    assert g["drawn"] == g["trained"] + sum(g["dropped"].values()) + g["in_flight"]
    assert e["drawn"] == 60 and e["lost"] == 0
    assert e["drawn"] == e["trained"] + sum(e["failed"].values()) + e["dropped"] + e["in_flight"]
    assert g["trained"] >= 6 and r["no_progress"] is None, r
    # every kind of fault happened, and was absorbed
    assert all(n > 0 for n in r["faults_injected"].values()), r
    assert r["engine_errors"] > 0 and r["interrupted_requests"] > 0 and r["retries"] > 0
    # a sandbox killed for memory and a search answered 500 twice (the client retries once) are tool
    # errors the model sees, not failed episodes (a call cut short by the step timeout records none)
    assert 0 < r["tool_call_errors"]["python"] <= r["faults_injected"]["sandbox_oom"], r
    assert 0 < r["tool_call_errors"]["search"] <= r["faults_injected"]["retrieval_500"], r
    # every failed attempt is on record with its error text
    attempts = [json.loads(line) for line in failures.read_text().splitlines()]
    assert len(attempts) == r["failed_attempts"] > 0 and r["failed_attempts_without_error"] == 0
    texts = [a["error"] for a in attempts]
    assert any(t.startswith("env: ChaosError: injected: env.step raised") for t in texts)
    assert any("took longer than rollout.env_step_timeout (1.5 s)" in t for t in texts)
    assert any(t.startswith("verifier chaos_bench failed: ChaosError: injected") for t in texts)
