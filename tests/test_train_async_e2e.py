"""End to end through the real main job: ``python train_async.py`` on a CI-sized Search-R1 config.

Everything is real: Ray (local), the retrieval server, the embedded engine over HTTP, the Megatron
trainer over gloo, distributed weight sync. The run trains a few steps, checkpoints, is resumed for more
steps, and must leave no server, engine or Ray process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.metrics import read_metrics
from agentrl.testing.configs import TINY_SEARCH_R1

ROOT = Path(__file__).resolve().parent.parent

CONFIG = (
    TINY_SEARCH_R1
    + """output_dir: {out}
steps: 3
engine: {{max_batch_size: 16}}
weight_sync: distributed
rollout: {{group_size: 4, batch_size: 2, max_staleness: 1, max_concurrency: 16, max_turns: 3,
          max_total_tokens: 600, sampling: {{temperature: 1.0, max_new_tokens: 24}},
          eval_sampling: {{temperature: 0.0, max_new_tokens: 24}}, verifier: exact_match,
          filter_zero_variance: false}}
trainer: {{device: cpu, lr: 1.0e-4, micro_batch_size: 8}}
eval: {{num_tasks: 8}}
checkpoint: {{interval: 2}}
"""
)


def _ours(pid: str) -> bool:
    """Started by this test session: it inherited the session's own TMPDIR (tests/conftest.py), so other
    jobs on the machine (their Ray, their engines) are not counted."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"TMPDIR={tempfile.gettempdir()}".encode() in env


def _leftovers() -> list[str]:
    """Processes a run may start: engines, retrieval servers, Ray daemons and workers."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    pats = ("agentrl.embedded.server", "retrieval_server", "raylet", "gcs_server", "ray::")
    return [
        line
        for line in out.splitlines()
        if any(p in line for p in pats) and "ps -eo" not in line and _ours(line.split()[0])
    ]


def _left_after(timeout: float = 60.0) -> list[str]:
    """The run's processes still alive after they had ``timeout`` s to exit (woken by each exit through
    a pidfd, not by polling): processes that a finished run still leaves behind."""
    fds = {}
    for line in _leftovers():
        with contextlib.suppress(OSError):  # already gone
            fds[os.pidfd_open(int(line.split()[0]))] = line
    deadline = time.monotonic() + timeout
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        alive = set(fds)
        while alive and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):  # a pidfd is readable once its process exited
                poller.unregister(fd)
                alive.discard(fd)
        return [fds[fd] for fd in alive]
    finally:
        for fd in fds:
            os.close(fd)


class _Lines:
    """A process's output lines, read by a thread: waiting for a line is bounded even when the process
    goes silent."""

    def __init__(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        stdout = proc.stdout
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=lambda: [*map(self._q.put, stdout), self._q.put(None)], daemon=True).start()
        self.seen: list[str] = []

    def until(self, prefix: str | None, timeout: float) -> bool:
        """Read until a line starting with ``prefix`` (None: until the end); False after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                return False
            if line is None:
                return prefix is None
            self.seen.append(line)
            if prefix is not None and line.startswith(prefix):
                return True
        return False


def _run(args: list[str], timeout: float = 600) -> str:
    proc = subprocess.run(
        [sys.executable, "train_async.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"train_async failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


@pytest.mark.slow
def test_train_async_trains_syncs_checkpoints_resumes_and_cleans_up(
    tmp_path: Path, search_r1_cache: Path
) -> None:
    assert not _leftovers(), "processes from an earlier test are still running"
    cfg = tmp_path / "e2e.yaml"
    out = tmp_path / "run"
    cfg.write_text(CONFIG.format(out=out, cache=search_r1_cache))

    stdout = _run(["--config", str(cfg)])
    assert "held-out exact match before" in stdout and "held-out exact match after" in stdout
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if "policy_version" in r]
    assert [r["policy_version"] for r in train] == [1, 2, 3]  # one sync per step
    for r in train:  # the staleness bound (η = 1) held for every trained token
        assert r["batch/staleness_max"] <= 1
        assert r["trainer/tokens_per_s"] > 0
        # the load of the rollout's event loop and of the retrieval server (one worker: one engine)
        assert 0 <= r["rollout/loop_busy_frac"] <= 1 and r["rollout/loop_lag_ms_p90"] >= 0
        assert 0 <= r["retrieval/busy_frac"] <= 1 and r["retrieval/workers"] == 1
    assert (out / "reward_em.png").stat().st_size > 1000
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_00000003"
    assert not _left_after(), "the run left processes behind"

    # resume: continues at step 3 with the checkpoint's weights pushed to the engine (version 4), then
    # trains two more steps
    stdout = _run(["--config", str(cfg), "--resume", "steps=5"])
    assert "resumed at step 3" in stdout
    rows = read_metrics(out / "metrics.jsonl")
    resumed = [r for r in rows if "policy_version" in r][3:]
    assert [r["step"] for r in resumed] == [4, 5]
    assert [r["policy_version"] for r in resumed] == [4, 5]  # the resume pushed version 3; no gap
    assert all(r["batch/staleness_max"] <= 1 for r in resumed)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting"]["trained"] >= 4
    # the step-time breakdown is the mean of the logged steps (this run's 2), and its parts fit in a step
    logged = [r["time/step_s"] for r in resumed]
    assert summary["mean_step_s"] == pytest.approx(sum(logged) / len(logged))
    parts = summary["mean_wait_batch_s"] + summary["mean_train_s"] + summary["mean_sync_s"]
    assert 0 < parts <= summary["mean_step_s"] * 1.01
    assert "engine_peak_gpu_mem_gb" not in summary  # a CPU engine reports no GPU memory
    assert 0 <= summary["rollout_loop_busy_frac"] <= 1 and summary["retrieval_request_ms_mean"] >= 0
    assert not _left_after(), "the resumed run left processes behind"


def test_bad_config_field_is_named(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "train_async.py", "rollout.group_sise=4", "trainer.lr=abc"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "rollout.group_sise: unknown field" in proc.stderr
    assert "trainer.lr" in proc.stderr


@pytest.mark.slow
def test_ctrl_c_shuts_everything_down(tmp_path: Path, search_r1_cache: Path) -> None:
    """SIGINT in the middle of training: the job exits and leaves no engine, server or Ray process."""
    import signal

    cfg = tmp_path / "e2e.yaml"
    cfg.write_text(
        CONFIG.format(out=tmp_path / "run", cache=search_r1_cache).replace("steps: 3", "steps: 500")
    )
    proc = subprocess.Popen(  # no held-out eval before training: the interrupt falls in a step sooner
        [sys.executable, "-u", "train_async.py", "--config", str(cfg), "eval.before=false"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # started with SIGINT ignored, as a background job of a non-interactive shell is (CI run that way
        # saw the job ignore Ctrl-C and train to its last step); the job must still stop
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    out = _Lines(proc)
    try:
        assert out.until("step 2/", timeout=400), "".join(out.seen[-40:])  # training is under way
        os.kill(proc.pid, signal.SIGINT)
        assert out.until(None, timeout=180), "no clean exit 180 s after Ctrl-C:\n" + "".join(out.seen[-40:])
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "the job did not stop on Ctrl-C:\n" + "".join(out.seen[-30:])
    assert any("interrupted" in line for line in out.seen)
    assert not _left_after(), "Ctrl-C left processes behind"


def _train_async_module(path: Path = ROOT / "train_async.py") -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_async", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_next_batch_ends_when_cancelled_even_as_the_batch_arrives() -> None:
    # Ctrl-C cancels the loop's wait for a batch. Whichever loop turn the batch lands in around the cancel,
    # a next_batch still running when cancelled ends cancelled (Python 3.11's wait_for returned the batch
    # instead, so the run would have trained on); cancelled before any batch, it cancels its request
    import asyncio
    from types import SimpleNamespace

    train_async = _train_async_module()
    next_batch = train_async.next_batch

    async def race(turns: int | None) -> tuple[bool, bool, bool]:
        batch = asyncio.get_running_loop().create_future()
        rollout = SimpleNamespace(get_batch=lambda: batch)  # a RolloutGroup's get_batch: awaited as is
        task = asyncio.ensure_future(next_batch(rollout, 1))
        for _ in range(3):
            await asyncio.sleep(0)  # next_batch is waiting
        if turns is not None:
            batch.set_result(["trajectory"])
            for _ in range(turns):
                await asyncio.sleep(0)
        requested = task.cancel()  # False: it had returned already
        try:
            await task
        except asyncio.CancelledError:
            return requested, True, batch.cancelled()
        return requested, False, batch.cancelled()

    for turns in range(8):
        requested, cancelled, _ = asyncio.run(race(turns))
        assert cancelled == requested, f"batch {turns} loop turns before the cancel"
    assert asyncio.run(race(None)) == (True, True, True)

    async def swallowed() -> None:  # an await elsewhere swallows the cancel: the next step still stops
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)
        train_async.stop_if_interrupted()

    async def cancel_it() -> bool:
        task = asyncio.ensure_future(swallowed())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait({task})
        return task.cancelled()

    assert asyncio.run(cancel_it())


def test_engine_memory_reports_the_largest_peak_and_never_fails_a_step() -> None:
    from agentrl.metrics import engine_metrics as engine_memory

    class Engines:  # what EngineClient.server_info returns: one dict per engine
        def __init__(self, infos: list[dict] | Exception) -> None:
            self.infos = infos

        async def server_info(self) -> list[dict]:
            if isinstance(self.infos, Exception):
                raise self.infos
            return self.infos

    import asyncio

    two_gpu = Engines([{"peak_gpu_mem_gb": 3.5}, {"peak_gpu_mem_gb": 7.25, "device": "cuda:1"}])
    assert asyncio.run(engine_memory(two_gpu)) == {"engine/peak_gpu_mem_gb": 7.25}
    assert asyncio.run(engine_memory(Engines([{"device": "cpu"}]))) == {}  # CPU engines, SGLang
    assert asyncio.run(engine_memory(Engines(ConnectionError("engine gone")))) == {}


@pytest.mark.slow
def test_a_run_that_can_never_score_stops_with_the_cause_and_the_field(
    tmp_path: Path, search_r1_cache: Path
) -> None:
    """Every group zero-variance (one new token: no answer, reward 0 everywhere) with
    rollout.filter_zero_variance on: the job exits non-zero within minutes, printing one line that names the
    cause and the field, instead of waiting for a batch that can never form."""
    cfg = tmp_path / "e2e.yaml"
    cfg.write_text(CONFIG.format(out=tmp_path / "run", cache=search_r1_cache))
    args = [
        "--config",
        str(cfg),
        "rollout.filter_zero_variance=true",
        "rollout.sampling.max_new_tokens=1",
        "eval.before=false",
    ]
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "train_async.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode != 0 and time.monotonic() - t0 < 600
    last = proc.stderr.strip().splitlines()[-1]
    assert "rollout.filter_zero_variance" in last and "zero" in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not _left_after(), "the run left processes behind"
