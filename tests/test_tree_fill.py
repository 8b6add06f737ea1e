"""Refilled trees (``rollout.tree.fill``, agentrl.rollout.tree): an episode that ends before its branch point
is sampled again from where it started, so a tree keeps ``k ** len(branch_at)`` leaves. A scripted engine
(its answer a function of the input ids and the request seed) and a scripted env (an action that says END
ends the episode, FAIL fails it) drive :class:`TreeRunner` directly."""

from __future__ import annotations

import asyncio
import copy
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from agentrl.buffer import StalenessController
from agentrl.chat import ChatTokenizer
from agentrl.engine.client import EngineClient
from agentrl.engine.types import GenerateResult, SamplingParams
from agentrl.envs.base import Env, StepResult
from agentrl.rollout import RolloutConfig
from agentrl.rollout.dataset import Draw
from agentrl.rollout.episode import EpisodeRunner, _seed_key
from agentrl.rollout.lockstep import request_seed
from agentrl.rollout.metrics import RolloutMetrics
from agentrl.rollout.tree import TreeRunner, generated_tokens, shared_prefix_tokens
from agentrl.trainer.losses import LossConfig, compute_tree_advantages
from agentrl.types import Status, Trajectory, TreePosition

pytestmark = pytest.mark.timeout(60)

DRAW = Draw("g0", {"id": "task0", "prompt": "What is 2 + 2?", "label": "4"})


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class ScriptEnv(Env):
    """Three turns; an action with END ends the episode at once, one with FAIL raises. Reward: the action
    text's length is odd. Forks by copy. ``fail_fork``: "second" fails the second fork taken at one step
    (a branch point's spare when k = 2), "unstepped" fails the fork of a fork that has not stepped yet (a
    re-sample from a spare). ``hold_close``: (gate, closing): an env that never stepped (a spare) sets
    closing and closes once gate is set. Every instance is kept, to check that all were closed."""

    scores_itself = True
    made: list[ScriptEnv] = []
    fail_fork: str | None = None
    hold_close: tuple[asyncio.Event, asyncio.Event] | None = None

    def __init__(self) -> None:
        self.steps = 0
        self.forks_here = 0
        self.unstepped = False
        self.closed = False
        ScriptEnv.made.append(self)

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.steps = 0
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        self.steps += 1
        self.forks_here, self.unstepped = 0, False
        if "FAIL" in action_text:
            raise RuntimeError("scripted failure")
        if "END" in action_text or self.steps >= 3:
            return StepResult(reward=float(len(action_text) % 2), terminated=True)
        return StepResult(f"turn {self.steps}")

    def fork(self) -> ScriptEnv:
        self.forks_here += 1
        if ScriptEnv.fail_fork == "second" and self.forks_here == 2:
            raise RuntimeError("second fork failed")
        if ScriptEnv.fail_fork == "unstepped" and self.unstepped:
            raise RuntimeError("fork of a fork failed")
        child = copy.copy(self)
        child.forks_here, child.unstepped, child.closed = 0, True, False
        ScriptEnv.made.append(child)
        return child

    async def close(self) -> None:
        if ScriptEnv.hold_close is not None and self.unstepped:  # a spare: held until the test lets it go
            gate, closing = ScriptEnv.hold_close
            closing.set()
            await gate.wait()
        self.closed = True


class ScriptEngine(EngineClient):
    """Answers from (input ids, sampling seed) only, after a random delay; a seed in ``script`` appends
    that word (END, FAIL). ``slow``: seeds answered 50 ms late; ``hold``: seeds whose request never answers
    (``held`` is set once one waits). Records every request and the episodes generating at once."""

    def __init__(
        self,
        tok: Any,
        script: dict[int, str],
        timing_seed: int = 0,
        hold: set[int] | None = None,
        slow: set[int] | None = None,
    ):
        super().__init__("http://127.0.0.1:1")
        self.tok = tok
        self.script = script
        self.hold = hold or set()
        self.slow = slow or set()
        self.held = asyncio.Event()
        self.delays = random.Random(timing_seed)
        self.plain = tok.encode(" one two three four five six", add_special_tokens=False)
        self.requests: list[tuple[list[int], int | None, list[int]]] = []
        self.live = self.most_live = 0

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *a: Any, **kw: Any
    ) -> GenerateResult:
        seed = sampling.sampling_seed
        self.live += 1
        self.most_live = max(self.most_live, self.live)
        try:
            if seed in self.hold:
                self.held.set()
                await asyncio.Event().wait()
            await asyncio.sleep(self.delays.random() * 0.003 + 0.05 * (seed in self.slow))
        finally:
            self.live -= 1
        rng = random.Random(hash((tuple(input_ids), seed)))
        ids = [rng.choice(self.plain) for _ in range(rng.randint(1, 4))]
        if seed in self.script:
            ids += self.tok.encode(" " + self.script[seed], add_special_tokens=False)
        self.requests.append((list(input_ids), seed, ids))
        return GenerateResult(ids, [-rng.random() for _ in ids], "stop", weight_version="0")


def config(branch_at: list[int], k: int, fill: bool = True) -> RolloutConfig:
    return RolloutConfig(
        group_size=1,
        batch_size=1,
        max_concurrency=64,
        max_turns=4,
        max_total_tokens=1024,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=8),
        tree={"branch_at": branch_at, "k": k, "fill": fill},
    )


def seed(cfg: RolloutConfig, path: list[int], turn: int) -> int:
    """The request seed of model turn ``turn`` (1-based) of the node at ``path`` in tree 0."""
    t = Trajectory("task0", DRAW.uid, [], sample_index=0)
    t.tree = TreePosition(f"{DRAW.uid}/0", list(path))
    return request_seed(cfg.seed, _seed_key(DRAW, t), 0, turn - 1)


async def grow(
    tok: Any, cfg: RolloutConfig, engine: ScriptEngine, m: RolloutMetrics | None = None
) -> list[Trajectory]:
    open_gate = asyncio.Event()
    open_gate.set()
    episodes = EpisodeRunner(
        cfg, engine, ChatTokenizer(tok), ScriptEnv, StalenessController(1, 1), open_gate, deterministic=True
    )
    assert cfg.tree is not None
    return await TreeRunner(episodes, cfg.tree).run(DRAW, 0, cfg.sampling, m or RolloutMetrics(), True)


@pytest.fixture(autouse=True)
def fresh_envs() -> Any:
    ScriptEnv.made, ScriptEnv.fail_fork, ScriptEnv.hold_close = [], None, None
    yield
    assert all(env.closed for env in ScriptEnv.made), "an env was left open"


def paths(leaves: list[Trajectory]) -> list[list[int]]:
    return [t.tree.path for t in leaves if t.tree is not None]


def first_request(engine: ScriptEngine, s: int) -> tuple[list[int], int | None, list[int]]:
    return next(r for r in engine.requests if r[1] == s)


async def test_a_root_that_ends_before_its_branch_point_is_sampled_again(tok):
    cfg = config([1, 2], 2)
    root_ends = {seed(cfg, [], 1): "END"}
    m = RolloutMetrics()
    engine = ScriptEngine(tok, root_ends)
    leaves = await grow(tok, cfg, engine, m)
    # the early root is child 0 of a branch at turn 0; its re-sample (budget 3) branches into budgets 2, 1
    assert paths(leaves) == [[0], [1, 0, 0], [1, 0, 1], [1, 1, 0]]
    root = leaves[0]
    assert root.tree == TreePosition("g0/0", [0], [0], [0]) and root.num_turns == 1
    for t in leaves[1:]:
        assert t.status == Status.COMPLETED and t.tree.branch_turns == [0, 1, 2]
        assert t.tree.branch_offsets[0] == 0 and t.prompt_ids == root.prompt_ids
    assert m.counters["tree_refills"] == 1 and m.counters["tree_leaves"] == 4
    # one spare, at the re-sample's first branch point (its children have budgets 2 and 1)
    assert m.counters["tree_forks"] == 1 + 1 + 1
    # the re-sample drew its own seeds: another first answer than the root's, from the same prompt
    root_req = first_request(engine, seed(cfg, [], 1))
    again_req = first_request(engine, seed(cfg, [1], 1))
    assert root_req[1] != again_req[1] and root_req[0] == again_req[0] and root_req[2] != again_req[2]
    assert again_req[2] == leaves[1].response_ids[: len(again_req[2])]
    # the counters agree with the leaves: every sampled token once, the prompt shared by the re-sample
    assert m.counters["tree_generated_tokens"] == generated_tokens(leaves)
    assert generated_tokens(leaves) == sum(len(r[2]) for r in engine.requests)
    assert m.counters["tree_shared_prefix_tokens"] == shared_prefix_tokens(leaves)

    ScriptEnv.made = []
    off = RolloutMetrics()
    leaves = await grow(tok, config([1, 2], 2, fill=False), ScriptEngine(tok, root_ends), off)
    assert paths(leaves) == [[]] and leaves[0].tree.branch_turns == []
    assert off.counters["tree_refills"] == 0 and off.counters["tree_forks"] == 0


async def test_a_child_that_ends_early_is_sampled_again_from_the_spare(tok):
    cfg = config([1, 2], 2)
    m = RolloutMetrics()
    engine = ScriptEngine(tok, {seed(cfg, [1], 2): "END"})
    leaves = await grow(tok, cfg, engine, m)
    # child 1 ended at turn 2; its re-sample is child 1 + k of the first branch point, with budget 1
    assert paths(leaves) == [[0, 0], [0, 1], [1], [3, 0]]
    by_path = {tuple(t.tree.path): t for t in leaves}
    again, early = by_path[(3, 0)], by_path[(1,)]
    cut = again.tree.branch_offsets[0]
    assert again.tree.branch_turns == [1, 2] and cut == early.tree.branch_offsets[0]
    assert (
        again.input_ids[: len(again.prompt_ids) + cut]
        == by_path[(0, 0)].input_ids[: len(again.prompt_ids) + cut]
    )
    assert again.response_ids[cut:] != early.response_ids[cut:]
    assert again.status == Status.COMPLETED and again.num_turns == 3
    assert m.counters["tree_refills"] == 1
    # forks: child 1 and the spare at turn 1, child (0, 1) at turn 2, the re-sample from the spare
    assert m.counters["tree_forks"] == 4 and m.counters["tree_fork_failures"] == 0
    assert m.counters["tree_shared_prefix_tokens"] == shared_prefix_tokens(leaves)
    assert m.counters["tree_generated_tokens"] == sum(len(r[2]) for r in engine.requests)


async def test_deterministic_refilled_trees_do_not_depend_on_timing(tok):
    cfg = config([1, 2], 2)
    # both children of the first branch point end at turn 2; either one ends first, so either one's
    # re-sample is forked from the spare first
    ends = [seed(cfg, [0], 2), seed(cfg, [1], 2)]
    runs = []
    for timing, slow in enumerate([ends[0], ends[1], None]):
        ScriptEnv.made = []
        engine = ScriptEngine(
            tok, dict.fromkeys(ends, "END"), timing_seed=timing, slow={slow} if slow else None
        )
        leaves = await grow(tok, cfg, engine)
        runs.append([(tuple(t.tree.path), t.response_ids) for t in leaves])
    assert runs[0] == runs[1] == runs[2]
    assert [p for p, _ in runs[0]] == [(0,), (1,), (2, 0), (3, 0)]


@pytest.mark.parametrize("k, branch_at", [(2, [1, 2]), (3, [1, 2]), (2, [1, 2, 3])])
async def test_budgets_bound_the_leaves_and_the_episodes_at_once(tok, k, branch_at):
    cfg = config(branch_at, k)
    if branch_at[-1] >= cfg.max_turns:
        cfg = cfg.model_copy(update={"max_turns": 5})
    budget = k ** len(branch_at)
    refills: list[int] = []
    for trial in range(6):
        # about a third of all requests end their episode: re-samples of re-samples, at every depth
        rng = random.Random(trial)
        script: dict[int, str] = {}
        nodes = (
            [[]]
            + [[a] for a in range(2 * budget)]
            + [[a, b] for a in range(2 * budget) for b in range(budget)]
        )
        for path in nodes:
            for turn in range(1, 4):
                if rng.random() < 0.35:
                    script[seed(cfg, path, turn)] = "END"
        grown = []
        for timing in (trial, trial + 100):  # the same tree whatever the timing (a deterministic run)
            ScriptEnv.made = []
            m = RolloutMetrics()
            engine = ScriptEngine(tok, script, timing_seed=timing)
            leaves = await grow(tok, cfg, engine, m)
            assert len(leaves) == budget and all(t.status == Status.COMPLETED for t in leaves)
            assert len({tuple(p) for p in paths(leaves)}) == budget and paths(leaves) == sorted(paths(leaves))
            assert engine.most_live <= budget
            assert m.counters["tree_generated_tokens"] == sum(len(r[2]) for r in engine.requests)
            assert all(env.closed for env in ScriptEnv.made)
            grown.append([(t.tree.path, t.response_ids) for t in leaves])
            refills.append(m.counters["tree_refills"])
        assert grown[0] == grown[1]
    assert max(refills) >= 3  # re-samples of re-samples


async def test_a_failed_episode_is_not_sampled_again(tok):
    cfg = config([1, 2], 2)
    m = RolloutMetrics()
    leaves = await grow(tok, cfg, ScriptEngine(tok, {seed(cfg, [], 1): "FAIL"}), m)
    assert [t.status for t in leaves] == [Status.FAILED] and m.counters["tree_refills"] == 0
    ScriptEnv.made = []
    m = RolloutMetrics()
    leaves = await grow(tok, cfg, ScriptEngine(tok, {seed(cfg, [1], 2): "FAIL"}), m)
    assert paths(leaves) == [[0, 0], [0, 1], [1]] and leaves[2].status == Status.FAILED
    assert m.counters["tree_refills"] == 0


@pytest.mark.parametrize("fail_fork", ["second", "unstepped"])
async def test_a_failed_spare_or_refill_fork_leaves_the_early_leaf(tok, fail_fork):
    ScriptEnv.fail_fork = fail_fork
    cfg = config([1, 2], 2)
    m = RolloutMetrics()
    leaves = await grow(tok, cfg, ScriptEngine(tok, {seed(cfg, [1], 2): "END"}), m)
    assert paths(leaves) == [[0, 0], [0, 1], [1]]
    assert all(t.status == Status.COMPLETED for t in leaves)
    assert m.counters["tree_fork_failures"] == 1 and m.counters["tree_refills"] == 0


async def test_cancelling_a_refilling_tree_closes_every_env(tok):
    cfg = config([1, 2], 2)
    # child 1 ends at turn 2; its re-sample (child 3, from the spare) never gets an answer
    engine = ScriptEngine(tok, {seed(cfg, [1], 2): "END"}, hold={seed(cfg, [3], 2)})
    task = asyncio.ensure_future(grow(tok, cfg, engine))
    await asyncio.wait_for(engine.held.wait(), 10)
    assert any(not env.closed for env in ScriptEnv.made)  # the spare and the re-sample are open
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_tree_cancelled_while_it_closes_its_spare_is_cancelled(tok):
    # every branch done, the root's branch point closes its spare; a cancellation then waits for the close
    # and is not lost: the tree ends cancelled, not with its leaves
    gate, closing = asyncio.Event(), asyncio.Event()
    ScriptEnv.hold_close = (gate, closing)
    task = asyncio.ensure_future(grow(tok, config([1, 2], 2), ScriptEngine(tok, {})))
    await asyncio.wait_for(closing.wait(), 10)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # the spare's close goes on
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_turn_terms_of_a_refilled_tree() -> None:
    """One tree, so the tree term is 0 under dr_grpo and the advantages are the turn terms alone. The root
    ended at turn 1 (leaf [0]); its re-sample [1] branched at turns 1 and 2; at the first of them child
    [1, 0] ended early and was sampled again as child [1, 2] (three children of one branch point)."""

    def leaf(path: list[int], offsets: list[int], reward: float) -> Trajectory:
        t = Trajectory("task0", "g0", [1, 2], sample_index=0, reward=reward)
        t.append_model_tokens([5] * 8, [-0.1] * 8, 0)
        t.tree = TreePosition("g0/0", path, [0, 1, 2][: len(offsets)], offsets)
        return t

    rows = [
        leaf([0], [0], 1.0),
        leaf([1, 0], [0, 2], 0.0),
        leaf([1, 1, 0], [0, 2, 4], 1.0),
        leaf([1, 1, 1], [0, 2, 4], 0.0),
        leaf([1, 2, 0], [0, 2, 4], 1.0),
    ]
    mask = torch.ones(len(rows), 8)
    rewards = torch.tensor([t.reward for t in rows])
    trees = [t.tree for t in rows]
    adv = compute_tree_advantages(
        rewards, ["g0"] * len(rows), mask, LossConfig(advantage_estimator="dr_grpo"), trees
    )
    # turn 0: the early root (1.0) against its re-sample's subtree (mean 0.5)
    assert adv[0].tolist() == [0.25] * 8
    # turn 1, three children: [1, 0] 0.0, [1, 1] 0.5, [1, 2] 1.0 around their mean 0.5
    # turn 2: [1, 1, 0] 1.0 against [1, 1, 1] 0.0; [1, 2] has one child, no term there
    assert adv[1].tolist() == [-0.25] * 2 + [-0.5] * 6
    assert adv[2].tolist() == [-0.25] * 2 + [0.0] * 2 + [0.5] * 4
    assert adv[3].tolist() == [-0.25] * 2 + [0.0] * 2 + [-0.5] * 4
    assert adv[4].tolist() == [-0.25] * 2 + [0.5] * 2 + [0.0] * 4
    grpo = compute_tree_advantages(rewards, ["g0"] * len(rows), mask, LossConfig(), trees)
    assert all(math.isfinite(x) for x in grpo.flatten().tolist())
    assert grpo[0, 0] > 0 > grpo[1, 0]  # the early root did better than its re-sample's subtree


async def test_refilled_leaves_give_finite_advantages(tok):
    cfg = config([1, 2], 2)
    leaves = []
    for i, script in enumerate([{seed(cfg, [], 1): "END"}, {seed(cfg, [1], 2): "END"}]):
        for t in await grow(tok, cfg, ScriptEngine(tok, script)):
            t.tree.tree_id = f"g0/{i}"
            leaves.append(t)
    width = max(len(t.response_ids) for t in leaves)
    mask = torch.tensor([t.loss_mask + [0] * (width - len(t.loss_mask)) for t in leaves], dtype=torch.float32)
    rewards = torch.tensor([t.reward for t in leaves])
    adv = compute_tree_advantages(rewards, ["g0"] * len(leaves), mask, LossConfig(), [t.tree for t in leaves])
    assert torch.isfinite(adv).all()
    # under dr_grpo: the early root's tokens carry its tree's term plus the turn-0 term, its reward
    # against its re-sample's subtree (the mean of the three leaves below it)
    dr = compute_tree_advantages(
        rewards,
        ["g0"] * len(leaves),
        mask,
        LossConfig(advantage_estimator="dr_grpo"),
        [t.tree for t in leaves],
    )
    r = rewards.double()
    tree_term = r[:4].mean() - (r[:4].mean() + r[4:].mean()) / 2
    turn0 = (r[0] - r[1:4].mean()) / 2
    assert leaves[0].tree.path == [0] and [t.tree.path[0] for t in leaves[1:4]] == [1, 1, 1]
    assert dr[0, 0].item() == pytest.approx((tree_term + turn0).item())
