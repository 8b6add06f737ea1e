"""Kill-and-resume: a training job SIGKILLed after a checkpoint and restarted from it ends with weights,
optimizer-driven updates, LR schedule, RNG-dependent data and policy version identical to a run that was
never interrupted (CPU, fixed seeds)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from agentrl.trainer.model import load_hf_state_dict

TESTS = str(Path(__file__).parent)


def _job(model_dir: Path, ckpt: Path, steps: int, out: Path, resume: bool) -> subprocess.Popen:
    code = (
        f"import sys; sys.path.insert(0, {TESTS!r}); from _trainer_helpers import run_training_job; "
        f"run_training_job({str(model_dir)!r}, {str(ckpt)!r}, {steps}, {str(out)!r}, {resume})"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def test_kill_and_resume_matches_uninterrupted(tiny_model_dir: Path, tmp_path: Path) -> None:
    steps = 5
    straight = _job(tiny_model_dir, tmp_path / "a", steps, tmp_path / "a.pt", resume=False)
    assert straight.wait(timeout=300) == 0

    victim = _job(tiny_model_dir, tmp_path / "b", steps, tmp_path / "never.pt", resume=True)
    assert victim.stdout is not None
    for line in victim.stdout:
        if line.strip() == "CKPT 2":
            victim.send_signal(signal.SIGKILL)  # mid-run, right after a checkpoint
            break
    victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "never.pt").exists()

    resumed = _job(tiny_model_dir, tmp_path / "b", steps, tmp_path / "b.pt", resume=True)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0
    first_resumed = int(out.split()[1])
    assert 3 <= first_resumed <= 4  # it continued from a checkpoint instead of starting over

    a = torch.load(tmp_path / "a.pt", weights_only=False)
    b = torch.load(tmp_path / "b.pt", weights_only=False)
    assert a["step"] == b["step"] == steps
    assert a["version"] == b["version"] == steps // 2
    assert a["lr"] == b["lr"]
    init = load_hf_state_dict(tiny_model_dir)
    assert set(a["weights"]) == set(b["weights"]) == set(init)
    assert any(not torch.equal(init[k], v) for k, v in a["weights"].items())  # training moved the weights
    for k, v in a["weights"].items():
        assert torch.equal(v, b["weights"][k]), k
