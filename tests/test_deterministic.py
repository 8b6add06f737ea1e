"""Deterministic mode (agentrl.rollout.lockstep): batches, versions and samples are a function of the
step, not of timing, while episodes run concurrently.

In-process: the orchestrator against an engine stand-in whose answer depends only on (input ids, seed,
weight version) and whose latency, like the env's, is random and different in each run. Through Ray:
two short ``train_async.py`` runs give the same final weights, bit for bit, and the same metrics apart
from timings.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from agentrl.buffer import Group
from agentrl.engine.client import EngineClient
from agentrl.engine.types import GenerateResult, SamplingParams
from agentrl.envs.base import Env, Message, StepResult
from agentrl.metrics import read_metrics, without_timings
from agentrl.rollout import Orchestrator, RolloutConfig
from agentrl.rollout.lockstep import LockstepSchedule, request_seed
from agentrl.testing.configs import TINY_SEARCH_R1
from agentrl.types import Trajectory

ROOT = Path(__file__).resolve().parent.parent


def test_request_seed_is_a_function_of_its_parts() -> None:
    s = request_seed(0, "0:3", 1, 2)
    assert s == request_seed(0, "0:3", 1, 2) and 0 <= s < 2**63
    others = {request_seed(1, "0:3", 1, 2), request_seed(0, "0:4", 1, 2), request_seed(0, "0:3", 0, 2)}
    assert s not in others | {request_seed(0, "0:3", 1, 1)}


def _grp(uid: str) -> Group:
    return Group(uid, [])


def test_lockstep_batches_take_draws_in_order_and_replace_drops() -> None:
    ls = LockstepSchedule(batch_size=2, max_staleness=1)
    assert [ls.version_of(b) for b in range(4)] == [0, 0, 1, 2]
    ls.start("a")
    ls.start("b")
    assert not ls.may_start(0)  # batch 0 is full
    ls.dropped("a")
    assert ls.may_start(0)  # its replacement comes from the next draw
    ls.start("c")
    assert ls.completed(_grp("c")) == []  # held until the batch is complete
    assert [g.uid for g in ls.completed(_grp("b"))] == ["b", "c"]  # draw order, not completion order
    assert ls.batch == 1 and ls.may_start(0) and not ls.caught_up(0)
    ls.start("d")
    ls.start("e")
    ls.completed(_grp("e"))
    ls.completed(_grp("d"))
    assert ls.caught_up(0) and not ls.may_start(0)  # batch 2 waits for version 1
    assert ls.may_start(1) and not ls.caught_up(1)


# ---------------------------------------------------------------- the orchestrator, in process
class SeededEngine(EngineClient):
    """Answers from (input ids, sampling seed, weight version) only, after a random delay; an unseeded
    request gets a seed from the engine's own generator, as the embedded engine does."""

    def __init__(self, timing_seed: int) -> None:
        super().__init__("http://127.0.0.1:1")
        self.version = 0
        self.delays = random.Random(timing_seed)
        self.in_flight = self.max_in_flight = 0

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delays.random() * 0.01)
        finally:
            self.in_flight -= 1
        seed = sampling.sampling_seed  # unseeded: drawn from the engine's generator, in arrival order
        seed = self.delays.getrandbits(62) if seed is None else seed
        rng = random.Random(hash((tuple(input_ids), seed, self.version)))
        n = rng.randint(1, sampling.max_new_tokens)
        ids = [rng.randrange(10, 200) for _ in range(n)]
        return GenerateResult(ids, [-rng.random() for _ in ids], "stop", weight_version=str(self.version))

    async def pause(self, mode: str = "abort") -> None:
        pass

    async def abort(self, rid: str | None = None) -> None:
        pass

    async def continue_generation(self) -> None:
        pass

    async def close(self) -> None:
        pass


class ParityEnv(Env):
    """Two turns; the reward is the parity of the last action's length (a function of the tokens), after
    a random tool latency."""

    scores_itself = True
    delays = random.Random(0)

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.turn = 0
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        await asyncio.sleep(self.delays.random() * 0.01)
        self.turn += 1
        if self.turn < 2:
            return StepResult(observation="more")
        return StepResult(reward=float(len(action_text) % 2), terminated=True)


async def _run(tok: Any, timing_seed: int, steps: int = 5) -> tuple[list[list[Trajectory]], int]:
    ParityEnv.delays = random.Random(timing_seed)
    engine = SeededEngine(timing_seed)
    cfg = RolloutConfig(
        group_size=3,
        batch_size=2,
        max_staleness=1,
        max_concurrency=64,
        max_turns=2,
        filter_zero_variance=True,  # dropped groups are replaced, in draw order
        shuffle=True,
        seed=7,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=12),
    )
    tasks = [{"id": f"t{i}", "prompt": f"task {i}"} for i in range(40)]
    orch = Orchestrator(cfg, engine, tok, ParityEnv, tasks, deterministic=True)
    await orch.start()
    batches = []
    for _ in range(steps):
        batch = await orch.buffer.get_batch(timeout=30)
        batches.append(batch)
        await orch.pause_for_update()  # waits until batch v + η is complete: nothing is running then
        assert not orch.ledger.running
        engine.version += 1
        await orch.resume_after_update(engine.version)
    await orch.stop()
    return batches, engine.max_in_flight


def _view(batch: list[Trajectory]) -> list[tuple]:
    return [
        (
            t.group_id,
            t.sample_index,
            t.prompt_ids,
            t.response_ids,
            t.rollout_logprobs,
            t.policy_versions,
            t.reward,
        )
        for t in batch
    ]


async def test_batches_and_versions_do_not_depend_on_timing(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    a, conc_a = await _run(tok, timing_seed=1)
    b, conc_b = await _run(tok, timing_seed=2)
    assert [_view(x) for x in a] == [_view(x) for x in b]
    assert conc_a > 1 and conc_b > 1  # episodes ran concurrently
    for k, batch in enumerate(a):  # batch k was generated under version max(0, k - η), whole
        assert {v for t in batch for v, m in zip(t.policy_versions, t.loss_mask, strict=True) if m} == {
            max(0, k - 1)
        }
        assert all(len({t.reward for t in batch if t.group_id == g}) > 1 for g in {t.group_id for t in batch})


# ---------------------------------------------------------------- two runs through Ray
CONFIG = (
    TINY_SEARCH_R1
    + """output_dir: {out}
steps: 3
deterministic: true
rollout: {{group_size: 4, batch_size: 2, max_staleness: 1, max_concurrency: 16, max_turns: 3,
          max_total_tokens: 600, sampling: {{temperature: 1.0, max_new_tokens: 24}},
          eval_sampling: {{temperature: 0.0, max_new_tokens: 24}},
          verifier: "agentrl.testing.verifiers:length_parity", filter_zero_variance: true}}
trainer: {{device: cpu, lr: 1.0e-3, micro_batch_size: 8}}
eval: {{num_tasks: 8}}
"""
)


# what may differ between two deterministic runs: clocks, durations, rates and latencies, the engine's
# batching counters (decode steps and rows, prefill and cached tokens: how requests were batched, which
# may vary with timing; what they produced may not), and the load of the rollout's event loop and of the
# retrieval server
Result = tuple[dict[str, torch.Tensor], list[dict[str, Any]]]


def _deterministic_runs(
    tmp: Path, cache: Path, runs: dict[str, tuple[str, ...]], rank: int = 0
) -> dict[str, Result]:
    """Runs of one config, each named with its overrides: rank ``rank``'s final weights and the metrics rows
    without timings of each. They run at the same time (a timing that differs all the more) when the
    bootstrap cache is built; otherwise each starts when the one before has built it, as runs would write
    it together."""
    built = any(cache.glob("sft-*/DONE"))
    procs = {}
    for name, overrides in runs.items():
        cfg = tmp / f"{name}.yaml"
        cfg.write_text(CONFIG.format(out=tmp / name, cache=cache))
        with open(tmp / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen(
                [sys.executable, "train_async.py", "--config", str(cfg), *overrides],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if not built:
            procs[name].wait()
    for proc in procs.values():  # all ended before any is checked: a failed one leaves no other behind
        proc.wait()
    results = {}
    for name, proc in procs.items():
        assert proc.returncode == 0, (tmp / f"{name}.log").read_text()[-8000:]
        out = tmp / name
        step = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
        weights = torch.load(step / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)["model"]
        results[name] = (weights, [without_timings(r) for r in read_metrics(out / "metrics.jsonl")])
        if not runs[name] and rank == 0:
            _PLAIN.setdefault(cache, results[name])
    return results


# the config's run without overrides, by bootstrap cache: the first of the session, for later comparisons
_PLAIN: dict[Path, Result] = {}
# the tests that run the plain config share a pytest-xdist worker (tests/conftest.py), this module's first:
# a later one compares against the plain run the pair test made
PLAIN_RUN_GROUP = pytest.mark.xdist_group("deterministic_plain_run")


def _against_the_plain_run(
    tmp: Path, cache: Path, name: str, overrides: tuple[str, ...]
) -> tuple[Result, Result]:
    """The config's plain run and a run ``name`` with ``overrides``. The plain run is the session's earlier
    one when there is one (the pair test ran it: deterministic, any plain run is every plain run, bit for
    bit); otherwise it runs beside ``name``."""
    if cache in _PLAIN:
        return _PLAIN[cache], _deterministic_runs(tmp, cache, {name: overrides})[name]
    runs = _deterministic_runs(tmp, cache, {"plain": (), name: overrides})
    return runs["plain"], runs[name]


def _deterministic_pair(tmp: Path, cache: Path, *overrides: str, rank: int = 0) -> tuple[Result, Result]:
    """Two runs ``a`` and ``b`` of one config with the same ``overrides`` (:func:`_deterministic_runs`)."""
    runs = _deterministic_runs(tmp, cache, {"a": overrides, "b": overrides}, rank)
    return runs["a"], runs["b"]


def _same_bytes(wa: dict[str, Any], wb: dict[str, Any]) -> None:
    tensors = [k for k, v in wa.items() if isinstance(v, torch.Tensor)]
    assert wa.keys() == wb.keys() and tensors
    for k in tensors:  # the same bytes (torch.equal would pass -0.0 == 0.0)
        assert wa[k].numpy().tobytes() == wb[k].numpy().tobytes(), f"{k} differs"


@pytest.mark.slow
@PLAIN_RUN_GROUP
def test_two_seeded_runs_are_bit_identical(tmp_path: Path, search_r1_cache: Path) -> None:
    (wa, ma), (wb, mb) = _deterministic_pair(tmp_path, search_r1_cache)
    _same_bytes(wa, wb)
    assert json.dumps(ma, sort_keys=True) == json.dumps(mb, sort_keys=True)
    train = [r for r in ma if "policy_version" in r]
    assert [r["policy_version"] for r in train] == [1, 2, 3]
    assert [r["batch/staleness_max"] for r in train] == [0.0, 1.0, 1.0]  # batch k ran under max(0, k - η)
    assert any(r["trainer/grad_norm"] > 0 for r in train)  # it trained


@pytest.mark.slow
def test_two_seeded_data_parallel_runs_are_bit_identical(tmp_path: Path, search_r1_cache: Path) -> None:
    """Two engines and two trainer ranks (data parallel), the rollout in two shards (an orchestrator per
    engine): each rank's weights are the same bytes in both runs, the two ranks hold the same replica,
    and every logged value is equal, the shards' merged figures included. (One orchestrator over two
    engines: the same pair ran on two GPUs, docs/results/multi-gpu.md.)"""
    dp2 = ("trainer_world_size=2", "engine.num_engines=2", "rollout.shards=2", "ray.num_cpus=4")
    (wa, ma), (wb, mb) = _deterministic_pair(tmp_path, search_r1_cache, *dp2, rank=1)
    _same_bytes(wa, wb)
    step = tmp_path / "a" / "checkpoints" / (tmp_path / "a" / "checkpoints" / "latest").read_text().strip()
    _same_bytes(torch.load(step / "rank_00000.pt", map_location="cpu", weights_only=False)["model"], wa)
    assert json.dumps(ma, sort_keys=True) == json.dumps(mb, sort_keys=True)
    train = [r for r in ma if "policy_version" in r]
    assert [r["policy_version"] for r in train] == [1, 2, 3] and any(
        r["trainer/grad_norm"] > 0 for r in train
    )
