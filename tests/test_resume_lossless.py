"""Lossless resume: a run checkpointed at step k, killed at a random point after it and resumed trains every
task exactly as often as a run that was never interrupted, its policy versions and metrics go on without a
gap, and with the deterministic (lockstep) schedule it trains the same batches, bit for bit.

What a crash costs (redone, never lost or trained twice): the steps trained after the last checkpoint
(their updates are not in it; fewer than ``checkpoint.interval`` steps plus the one under way) and the
generation of the groups in flight at the checkpoint, at most ``(η + 1)·B`` groups plus the over-sampling
allowance (admission, :mod:`agentrl.buffer`); each of those tasks is re-drawn, under its uid, and
trained once.

In process (the orchestrator against a seeded engine stand-in, random timings): the rollout's side, with
a checkpoint at a random moment. Through ``train_async.py`` (Ray, the embedded engine, the Megatron
trainer, all on CPU): the whole job SIGKILLed at a random point after its checkpoint, then ``--resume``.
The killed job's env holds every task past the first ``STEPS - 1`` batches' (``tests/_gated_env.py``), so
it cannot reach its next checkpoint (the last step) before the kill, however late the watcher sees it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_deterministic import ParityEnv, SeededEngine, _view
from transformers import AutoTokenizer

from agentrl.engine.types import SamplingParams
from agentrl.envs.base import Message, StepResult
from agentrl.metrics import read_metrics, without_timings
from agentrl.rollout import Orchestrator, RolloutConfig
from agentrl.run_config import CheckpointConfig
from agentrl.types import Trajectory


# ---------------------------------------------------------------- in process
def _cfg(eta: int) -> RolloutConfig:
    return RolloutConfig(
        group_size=3,
        batch_size=2,
        max_staleness=eta,
        max_concurrency=64,
        max_turns=2,
        filter_zero_variance=True,  # dropped groups are replaced, in draw order
        shuffle=True,
        seed=7,
        epochs=1,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=12),
        record_outcomes=True,
    )


ROOT = Path(__file__).resolve().parent.parent
TASKS = [{"id": f"t{i}", "prompt": f"task {i}"} for i in range(40)]


class GatedEnv(ParityEnv):
    """ParityEnv whose steps wait while the gate is closed, unless their task was let through."""

    closed = False
    let_through: set[str] = set()

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.task_id = task["id"]
        return await super().reset(task)

    async def step(self, action_text: str) -> StepResult:
        while GatedEnv.closed and self.task_id not in GatedEnv.let_through:
            await asyncio.sleep(0.001)
        return await super().step(action_text)


async def _steps(
    orch: Orchestrator, engine: SeededEngine, steps: int, rng: random.Random, close_gate: bool = False
) -> list[list[Trajectory]]:
    """The trainer's loop: a batch, then a weight update (version + 1); random pauses between. With
    ``close_gate`` the env's gate closes before the last update (the episodes started after it wait)."""
    out = []
    for i in range(steps):
        out.append(await orch.buffer.get_batch(timeout=30))
        await asyncio.sleep(rng.random() * 0.01)
        await orch.pause_for_update()
        engine.version += 1
        GatedEnv.closed = close_gate and i == steps - 1
        await orch.resume_after_update(engine.version)
    return out


async def _until(predicate: Any) -> None:
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("timed out")


async def _interrupted(
    tok: Any, eta: int, deterministic: bool, timing_seed: int, steps: int, k: int
) -> list[list[Trajectory]]:
    """k steps, a checkpoint, a new orchestrator resumed from it for the other steps. A deterministic run
    is checkpointed with the open batch's groups finished out of draw order: its last-drawn group done
    (held), the ones drawn before it still running."""
    ParityEnv.delays = random.Random(timing_seed)
    engine = SeededEngine(timing_seed)
    GatedEnv.let_through = set()
    orch = Orchestrator(_cfg(eta), engine, tok, GatedEnv, TASKS, deterministic=deterministic)
    await orch.start()
    before = await _steps(orch, engine, k, random.Random(timing_seed), close_gate=deterministic)
    if orch.lockstep is not None:
        lockstep = orch.lockstep
        await _until(lambda: len(lockstep.open_uids()) == orch.cfg.batch_size)
        last = lockstep.open_uids()[-1]
        GatedEnv.let_through = {orch.ledger.running[last].draw.task["id"]}
        await _until(lambda: last in {g.uid for _, g in lockstep._done})
        assert lockstep.open_uids()[-1] == last and len(orch.ledger.running) == orch.cfg.batch_size - 1
    else:
        await asyncio.sleep(random.Random(timing_seed).random() * 0.03)  # some random moment
    state = json.loads(json.dumps(orch.state_dict()))
    acc = orch.accounting()
    uids = [p["uid"] for p in state["pending"]]
    assert len(uids) == len(set(uids)) == acc["in_flight"] and acc["balanced"] == 1
    await orch.stop()
    GatedEnv.closed = False

    resumed = Orchestrator(_cfg(eta), engine, tok, GatedEnv, TASKS, deterministic=deterministic)
    resumed.load_state_dict(state, version=k)
    await resumed.start()
    after = await _steps(resumed, engine, steps - k, random.Random(timing_seed + 1))
    await resumed.stop()
    assert resumed.accounting()["balanced"] == 1
    return before + after


@pytest.mark.parametrize("eta", [0, 1])
@pytest.mark.parametrize("deterministic", [True, False])
async def test_rollout_resume_redraws_in_order_and_trains_each_task_once(
    tiny_model_dir: Path, eta: int, deterministic: bool
) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    steps, k = 8, 3
    ParityEnv.delays = random.Random(1)
    engine = SeededEngine(1)
    orch = Orchestrator(_cfg(eta), engine, tok, GatedEnv, TASKS, deterministic=deterministic)
    await orch.start()
    straight = await _steps(orch, engine, steps, random.Random(1))
    await orch.stop()

    for timing_seed in (2, 3):
        batches = await _interrupted(tok, eta, deterministic, timing_seed, steps, k)
        trained = Counter(t.group_id for b in batches for t in b if t.sample_index == 0)
        assert max(trained.values()) == 1 and len(trained) == steps * 2  # none trained twice, none skipped
        if deterministic and eta == 0:  # every batch is generated under the version it is trained at
            assert [_view(b) for b in batches] == [_view(b) for b in straight], timing_seed


def test_checkpoint_is_due_at_every_interval_and_never_when_off() -> None:
    """The loop's schedule (the last step is saved once more only when no interval checkpoint fell on it)."""
    assert [s for s in range(1, 8) if CheckpointConfig(interval=3).due(s)] == [3, 6]
    assert not any(CheckpointConfig().due(s) for s in range(1, 8))


# ---------------------------------------------------------------- the whole job, killed and resumed
STEPS, CKPT, B = 6, 3, 2  # 6 steps of 2 groups: the 12 training tasks, one pass (rollout.epochs 1)

CONFIG = """output_dir: {out}
steps: {steps}
deterministic: {deterministic}
model_path: {model}
data: {{path: {data}}}
env: {{name: "_gated_env:GatedMathEnv", kwargs: {{admit: {admit}}}}}
engine: {{max_batch_size: 8}}
rollout: {{group_size: 2, batch_size: {b}, max_staleness: {eta}, max_concurrency: 8, max_turns: 1,
          max_total_tokens: 256, epochs: 1, sampling: {{temperature: 1.0, max_new_tokens: 24}},
          filter_zero_variance: false, dump: all}}
trainer: {{device: cpu, lr: 1.0e-3, micro_batch_size: 4}}
eval: {{before: false, after: false}}
checkpoint: {{interval: {ckpt}}}
ray: {{num_cpus: 2}}
"""
# per-step figures that may differ between a run and its resumed continuation besides the timings
# (TIMING_KEYS): the rollout's work counters (the groups in flight at the checkpoint are generated again
# after a resume)
RESUME_COUNTERS = re.compile(r"policy_version$|^rollout/|^buffer/|^staleness/")


class Job:
    """One ``train_async.py`` in a session of its own (a SIGKILL to its group takes Ray's daemons and
    workers with it; the engine leaves when its parent does)."""

    def __init__(self, tmp: Path, name: str, deterministic: bool, eta: int, model: Path, data: Path) -> None:
        self.out = tmp / name
        self.cfg = tmp / f"{name}.yaml"
        self.fields = {
            "out": self.out,
            "steps": STEPS,
            "deterministic": str(deterministic).lower(),
            "model": model,
            "data": data,
            "b": B,
            "eta": eta,
            "ckpt": CKPT,
        }
        self.proc: subprocess.Popen | None = None

    def start(self, *args: str, admit: int | None = None) -> None:
        """Start the job; with ``admit`` its env holds the episodes of every task past the first ``admit``."""
        self.cfg.write_text(CONFIG.format(**self.fields, admit="null" if admit is None else admit))
        log = (self.out.parent / f"{self.out.name}{''.join(args)}.log").open("w")
        path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}  # the driver and Ray's workers import the gated env
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "train_async.py", "--config", str(self.cfg), *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
        )
        self.log = Path(log.name)

    def logged_steps(self) -> list[int]:
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return []
        return [int(r["step"]) for r in read_metrics(path) if "policy_version" in r]

    def kill_after(self, step: int, jitter: float, timeout: float = 240) -> None:
        """SIGKILL the job's whole process group ``jitter`` seconds after it logged ``step``."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while step not in self.logged_steps():
            assert self.proc.poll() is None, (
                f"the job ended before step {step}:\n{self.log.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, (
                f"no step {step} in {timeout} s:\n{self.log.read_text()[-3000:]}"
            )
            time.sleep(0.002)
        time.sleep(jitter)
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def kill(self) -> None:
        """SIGKILL the job's group if it still runs (a failed test must not leave it to the next ones)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def wait(self, timeout: float = 300) -> str:
        assert self.proc is not None
        self.proc.wait(timeout=timeout)
        text = self.log.read_text()
        assert self.proc.returncode == 0, text[-5000:]
        return text

    def dumps(self) -> dict[int, list[dict[str, Any]]]:
        """The training batch of every step, as the dumps hold it now (a resumed run rewrites its steps)."""
        out = {}
        for f in sorted((self.out / "trajectories").glob("step_*.jsonl.gz")):
            with gzip.open(f, "rt") as fh:
                out[int(f.name[5:11])] = [r for line in fh if (r := json.loads(line))["kind"] == "train"]
        return out

    def rows(self) -> dict[int, dict[str, Any]]:
        """The last logged row of every step."""
        return {int(r["step"]): r for r in read_metrics(self.out / "metrics.jsonl") if "policy_version" in r}


def _training_view(records: list[dict[str, Any]], version_offset: int) -> list[tuple]:
    """What the trainer got, bit for bit: tokens, masks, logprobs both sides, rewards; versions shifted by
    ``version_offset`` (the policy versions a resumed run counts, see the test)."""
    return [
        (
            r["group_id"],
            r["sample_index"],
            r["prompt_ids"],
            r["response_ids"],
            r["loss_mask"],
            r["rollout_logprobs"],
            r["trainer_logprobs"],
            r["reward"],
            [v - version_offset if v >= 0 else v for v in r["policy_versions"]],
        )
        for r in records
    ]


def _leftover_processes() -> list[str]:
    from test_train_async_e2e import _left_after

    return _left_after(timeout=60)


@pytest.mark.slow
def test_job_killed_after_a_checkpoint_resumes_losslessly(
    tmp_path: Path, tiny_model_dir: Path, request: pytest.FixtureRequest
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"task_id": f"q{i}", "prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(16)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:12]))
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[12:]))
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    where = f"(kill points from seed {seed})"
    engine_dirs = {p.name for p in Path(tempfile.gettempdir()).glob("agentrl-engine-*")}
    # the async schedule (η = 1) and the lockstep one (deterministic, η = 0: every batch is generated
    # under the version it is trained at, so a resumed run can repeat it exactly), side by side
    jobs = {
        "async": Job(tmp_path, "async", False, 1, tiny_model_dir, data),
        "lockstep": Job(tmp_path, "lockstep", True, 0, tiny_model_dir, data),
    }
    kill_at = {name: rng.randint(CKPT + 1, STEPS - 1) for name in jobs}
    request.addfinalizer(lambda: [job.kill() for job in jobs.values()])
    for job in jobs.values():
        job.start(admit=(STEPS - 1) * B)  # the tasks of steps 1 .. STEPS - 1: never the last step
    with ThreadPoolExecutor(len(jobs)) as pool:  # each job watched (and killed) on its own
        kills = [pool.submit(job.kill_after, kill_at[n], rng.random() * 0.3) for n, job in jobs.items()]
        for kill in kills:
            kill.result()
    killed: dict[str, dict[str, Any]] = {}
    for name, job in jobs.items():
        assert job.proc is not None and job.proc.returncode == -signal.SIGKILL, where
        assert (job.out / "checkpoints" / "latest").read_text().strip() == f"step_{CKPT:08d}", where
        killed[name] = {"dumps": job.dumps(), "rows": job.rows()}
    for job in jobs.values():
        job.start("--resume")
    for name, job in jobs.items():
        out = job.wait()
        assert f"resumed at step {CKPT}" in out, where
        version = int(re.search(r"resumed at step \d+, policy version (\d+)", out).group(1))
        offset = (
            version - CKPT
        )  # 0: the resume pushes the checkpoint's weights as the version they were saved at
        dumps, rows = job.dumps(), job.rows()
        # none skipped, none trained twice: the batches of steps 1..k (before the kill) and k+1..K
        # (after the resume) hold each of the 12 tasks exactly once
        trained = Counter(
            r["task_id"] for s in range(1, STEPS + 1) for r in dumps[s] if r["sample_index"] == 0
        )
        assert sorted(dumps) == list(range(1, STEPS + 1)) and trained == Counter(
            f"q{i}" for i in range(12)
        ), where
        assert all(r["trained"] and r["status"] != "failed" for s in dumps for r in dumps[s]), where
        # policy versions and metrics go on without a gap; cumulative counters continue from the checkpoint
        assert sorted(rows) == list(range(1, STEPS + 1)), where
        assert [rows[s]["policy_version"] for s in range(CKPT + 1, STEPS + 1)] == [
            s + offset for s in range(CKPT + 1, STEPS + 1)
        ], where
        assert offset == 0, where
        for s, r in rows.items():
            assert r["rollout/trained_groups"] == s * B, (where, s)
            assert r["batch/staleness_max"] <= (1 if name == "async" else 0), (where, s)
        # the steps the killed job had trained after its checkpoint were trained again after the resume (a
        # step's batch is dumped before its row is logged: the kill may fall between the two)
        redone = [s for s in killed[name]["dumps"] if s > CKPT]
        assert redone and max(redone) >= kill_at[name] and kill_at[name] in killed[name]["rows"], where
        if name == "lockstep":  # ... the same batches, bit for bit, and the same figures
            for s in redone:
                assert _training_view(dumps[s], offset) == _training_view(killed[name]["dumps"][s], 0), (
                    where,
                    s,
                )
            for s in (s for s in redone if s in killed[name]["rows"]):
                again = {k: v for k, v in without_timings(rows[s]).items() if not RESUME_COUNTERS.search(k)}
                first = {
                    k: v
                    for k, v in without_timings(killed[name]["rows"][s]).items()
                    if not RESUME_COUNTERS.search(k)
                }
                assert again == first and len(again) > 20, (where, s)
                pv = "trainer/policy_version"
                assert rows[s][pv] == killed[name]["rows"][s][pv] + offset, (where, s)
    assert not _leftover_processes(), "the killed or resumed jobs left processes behind"
    # a killed job never removed its engine's scratch dir (the port file; the engine itself left with its
    # parent): at most one per killed job, and none from the resumed ones
    scratch = [p for p in Path(tempfile.gettempdir()).glob("agentrl-engine-*") if p.name not in engine_dirs]
    assert len(scratch) <= len(jobs), scratch
    for p in scratch:
        shutil.rmtree(p)
