"""The main job colocated on one device (CPU): weights in memory (``weight_sync: tensor``), the engine asleep
while the trainer steps, the trainer's state offloaded while the engine generates. It trains and reports
each phase in ``summary.json``; Ctrl-C while the engine sleeps shuts everything down."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from test_train_async_e2e import CONFIG, ROOT, _left_after, _leftovers, _Lines

COLOCATED = (
    CONFIG.replace("weight_sync: distributed", "weight_sync: tensor")
    + "placement: colocated\ncolocation: {{mode: turns, engine_release: all, trainer_offload: ahead}}\n"
)


def _config(tmp_path: Path, cache: Path, steps: int) -> Path:
    cfg = tmp_path / "colocated.yaml"
    text = COLOCATED.format(out=tmp_path / "run", cache=cache).replace("steps: 3", f"steps: {steps}")
    cfg.write_text(text.replace("checkpoint: {interval: 2}", "checkpoint: {interval: 0}"))
    return cfg


def test_colocated_run_sleeps_offloads_and_reports_each_phase(tmp_path: Path, search_r1_cache: Path) -> None:
    assert not _leftovers(), "processes from an earlier test are still running"
    proc = subprocess.run(
        [sys.executable, "train_async.py", "--config", str(_config(tmp_path, search_r1_cache, 2))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["policy_version"] == 2
    phases = (
        "engine_release trainer_onload engine_resume_weights weight_sync trainer_offload engine_resume_kv"
    )
    for phase in [*phases.split(), "to_trainer"]:
        assert summary[f"mean_{phase}_s"] > 0, phase
    # the sync in memory's parts: HF weights assembled, packed into one buffer, the engines' call
    parts = [summary[f"mean_weight_sync_{p}_s"] for p in ("gather", "pack", "push")]
    assert all(p > 0 for p in parts) and sum(parts) <= summary["mean_weight_sync_s"] * 1.01
    # the release and the onload run side by side inside to_trainer (how much they overlap is timing);
    # from step 2 on the onload starts while the batch is still generating (colocation.trainer_offload:
    # ahead), and to_trainer waits only for its rest
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "time/to_trainer_s" in r]
    assert len(steps) == 2 and "time/trainer_onload_wait_s" in steps[1]
    for r in steps:
        assert r["time/engine_release_s"] <= r["time/to_trainer_s"] + 1e-3
        assert r.get("time/trainer_onload_wait_s", 0) <= r["time/to_trainer_s"] + 1e-3
    parts = summary["mean_wait_batch_s"] + summary["mean_train_s"] + summary["mean_sync_s"]
    assert 0 < parts <= summary["mean_step_s"] * 1.01
    assert 0 <= summary["engine_idle_frac"] <= 1
    assert summary["generated_tokens_per_s"] > 0
    # measured between the two steps' reads: with batch 2 generated during step 1's wait (max_staleness 1),
    # step 2 may pause the engine before it ran a step, and 0 is then the right figure
    assert 0 <= summary["engine_device_busy_frac"] <= 1
    assert not _left_after(), "the run left processes behind"


def test_overlapped_run_generates_beside_the_step_and_trains(tmp_path: Path, search_r1_cache: Path) -> None:
    """colocation.mode overlap: no release, no offload; generation pauses for the weight sync only."""
    cfg = _config(tmp_path, search_r1_cache, 2)
    text = cfg.read_text().replace(
        "colocation: {mode: turns, engine_release: all, trainer_offload: ahead}",
        "colocation: {mode: overlap}",
    )
    assert "mode: overlap" in text
    cfg.write_text(text)
    proc = subprocess.run(
        [sys.executable, "train_async.py", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["policy_version"] == 2 and summary["accounting"]["trained"] > 0
    assert not [
        k for k in summary if "engine_release" in k or "trainer_onload" in k or "trainer_offload" in k
    ]
    assert summary["mean_train_s"] > 0 and summary["mean_sync_s"] > 0
    parts = [summary[f"mean_weight_sync_{k}_s"] for k in ("gather", "pack", "push")]
    assert (
        all(p > 0 for p in parts)
        and sum(parts) <= summary["mean_weight_sync_s"] * 1.01 <= summary["mean_sync_s"] * 1.01
    )
    assert not _left_after(), "the run left processes behind"


def test_ctrl_c_while_the_engine_sleeps_shuts_everything_down(tmp_path: Path, search_r1_cache: Path) -> None:
    cfg = _config(tmp_path, search_r1_cache, 500)
    proc = subprocess.Popen(  # no held-out eval before training: the interrupt falls in a step sooner
        [sys.executable, "-u", "train_async.py", "--config", str(cfg), "eval.before=false"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = _Lines(proc)
    try:
        assert out.until("step 1/", timeout=600), "".join(out.seen[-40:])
        log = (tmp_path / "run" / "engine_0.log").read_text()
        url = re.findall(r"serving on (http://\S+)", log)[-1]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # wait for a step's train phase: the engine asleep
            info = httpx.get(f"{url}/get_server_info", timeout=10, trust_env=False).json()
            if info["asleep"]:
                break
            time.sleep(0.02)
        else:
            raise AssertionError("the engine never slept")
        os.kill(proc.pid, signal.SIGINT)
        assert out.until(None, timeout=180), "no clean exit 180 s after Ctrl-C:\n" + "".join(out.seen[-40:])
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert any("interrupted" in line for line in out.seen), "".join(out.seen[-30:])
    assert not _left_after(), "Ctrl-C during the sleep left processes behind"
