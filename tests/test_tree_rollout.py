"""Tree rollouts (agentrl.rollout.tree) against the stub engine over HTTP: the config's checks, trees that
share their tokens, forks by the env's own fork and by replay, the refusal of an env that cannot branch,
and the tree figures."""

from __future__ import annotations

import asyncio
import copy
import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentrl.engine.client import EngineClient
from agentrl.engine.types import GenerateResult, SamplingParams
from agentrl.envs.base import Env, StepResult
from agentrl.rollout import Orchestrator, RolloutConfig
from agentrl.rollout.tree import generated_tokens, shared_prefix_tokens, tree_stats
from agentrl.testing.envs import SyntheticEnv
from agentrl.testing.stub_engine import stub_engine_in_process
from agentrl.types import Status, Trajectory, TreePosition

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class RecordingClient(EngineClient):
    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.inputs: list[list[int]] = []

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *a: Any, **kw: Any
    ) -> GenerateResult:
        self.inputs.append(list(input_ids))
        return await super().generate(input_ids, sampling, *a, **kw)


class ForkingEnv(SyntheticEnv):
    """SyntheticEnv with a fork of its own: a copy whose rewards are drawn apart from its parent's."""

    def fork(self) -> ForkingEnv:
        child = copy.copy(self)
        child.actions = list(self.actions)
        child.rng = random.Random(self.rng.random())
        return child


class ReplayEnv(Env):
    """Deterministic, no fork of its own: forked by replay. Reward: the actions' total length is even."""

    deterministic = True
    scores_itself = True

    def __init__(self) -> None:
        self.actions: list[str] = []

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.actions = []
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        self.actions.append(action_text)
        if len(self.actions) >= 3:
            return StepResult(reward=float(sum(map(len, self.actions)) % 2), terminated=True)
        return StepResult(f"seen {len(self.actions)}: {len(action_text)} chars")


class PlainEnv(SyntheticEnv):
    pass


def cfg(**kw: Any) -> RolloutConfig:
    base: dict[str, Any] = {
        "group_size": 2,
        "batch_size": 2,
        "max_staleness": 1,
        "max_concurrency": 32,
        "max_turns": 4,
        "max_total_tokens": 1024,
        "filter_zero_variance": False,
        "shuffle": False,
        "sampling": SamplingParams(temperature=1.0, max_new_tokens=12),
        "tree": {"branch_at": [1, 2], "k": 2},
    }
    base.update(kw)
    return RolloutConfig(**base)


def tasks(n: int) -> list[dict[str, Any]]:
    return [{"id": f"task{i}", "prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(n)]


def test_tree_config_checks_name_the_field():
    with pytest.raises(ValueError, match=r"rollout.tree.branch_at: model turns .* ascending"):
        cfg(tree={"branch_at": [2, 1], "k": 2})
    with pytest.raises(ValueError, match=r"rollout.tree.branch_at: turn 4 .*max_turns = 4"):
        cfg(tree={"branch_at": [1, 4], "k": 2})
    with pytest.raises(
        ValueError, match=r"rollout.tree: a group grows up to .* 8 episodes.*max_concurrency \(4\)"
    ):
        cfg(max_concurrency=4)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        cfg(tree={"branch_at": [1], "k": 0})
    assert cfg().group_episodes == 8 and cfg(tree=None).group_episodes == 2


def _check_tree(batch: list[Trajectory], inputs: list[list[int]], leaves: int) -> None:
    by_tree: dict[str, list[Trajectory]] = {}
    for t in batch:
        t.validate()
        assert t.status == Status.COMPLETED and t.tree is not None
        by_tree.setdefault(t.tree.tree_id, []).append(t)
    for rows in by_tree.values():
        assert len(rows) == leaves
        assert sorted(tuple(t.tree.path) for t in rows) == [(a, b) for a in (0, 1) for b in (0, 1)]
        assert {t.group_id for t in rows} == {rows[0].group_id}
        for t in rows:
            assert t.tree.branch_turns == [1, 2]
            for d, offset in enumerate(t.tree.branch_offsets):
                # every leaf below a branch point holds the same ids before it, and the turn it branched
                # after ends exactly there (its observation included)
                below = [u for u in rows if u.tree.path[:d] == t.tree.path[:d]]
                assert {tuple(u.input_ids[: len(u.prompt_ids) + offset]) for u in below} == {
                    tuple(t.input_ids[: len(t.prompt_ids) + offset])
                }
                assert t.turns[2 * d + 1].role == "observation" and t.turns[2 * d + 1].end == offset
            # each sibling's first request after the branch sent the shared prefix as it is
            last = t.tree.branch_offsets[-1]
            assert t.input_ids[: len(t.prompt_ids) + last] in inputs


async def test_trees_share_their_tokens_and_every_leaf_is_a_trajectory(tok):
    async with stub_engine_in_process(min_tokens=2, max_tokens=8, seed=3) as (_, url):
        client = RecordingClient(url, timeout=10)
        orch = Orchestrator(cfg(), client, tok, lambda: ForkingEnv(turns=3), tasks(4))
        await orch.start()
        batch = await orch.buffer.get_batch(timeout=30)
        for t in batch:
            assert orch.version - t.min_policy_version <= orch.cfg.max_staleness
        stats = orch.stats()
        await orch.stop()
        await client.close()
    assert len(batch) == 2 * 2 * 4  # batch_size groups x group_size trees x 4 leaves
    _check_tree(batch, client.inputs, 4)
    assert (
        stats["rollout/tree_leaves"] >= 16 and stats["rollout/tree_forks"] >= 3 * stats["rollout/tree_trees"]
    )
    figures = tree_stats(batch)
    assert figures["tree/leaves_per_task"] == 8 and figures["tree/leaves_per_tree"] == 4
    assert figures["tree/generated_tokens"] < figures["tree/leaf_model_tokens"]
    assert figures["tree/shared_prefix_tokens"] > 0
    assert orch.accounting()["balanced"] == 1


async def test_a_deterministic_env_is_forked_by_replay(tok):
    made: list[ReplayEnv] = []

    def factory() -> ReplayEnv:
        made.append(ReplayEnv())
        return made[-1]

    async with stub_engine_in_process(min_tokens=2, max_tokens=8, seed=5) as (_, url):
        client = RecordingClient(url, timeout=10)
        orch = Orchestrator(cfg(batch_size=1), client, tok, factory, tasks(4))
        await orch.start()
        batch = await orch.buffer.get_batch(timeout=30)
        await orch.stop()
        await client.close()
    _check_tree(batch, client.inputs, 4)
    # a replayed env saw its branch's actions again, then its own
    for t in batch:
        assert len([x for x in t.turns if x.role == "assistant"]) == 3


def test_generated_and_shared_tokens_count_a_shared_segment_once():
    def leaf(path: list[int], n: int) -> Trajectory:
        t = Trajectory("t", "g", [1, 2], sample_index=0)
        t.append_model_tokens([5] * 3, [0.0] * 3, 0)
        t.append_observation_tokens([7] * 2)
        t.append_model_tokens([6] * n, [0.0] * n, 0)
        t.tree = TreePosition("g/0", path, [1], [5])
        return t

    rows = [leaf([0], 4), leaf([1], 2)]
    assert generated_tokens(rows) == 3 + 4 + 2
    assert shared_prefix_tokens(rows) == 2 + 5


async def test_an_env_that_cannot_branch_is_refused_at_start(tok):
    async with stub_engine_in_process() as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(cfg(), client, tok, lambda: PlainEnv(), tasks(2))
        with pytest.raises(ValueError, match=r"env 'PlainEnv' .*cannot branch"):
            await orch.start()
        await client.close()


def test_a_run_config_with_an_env_that_cannot_branch_fails_at_load():
    from agentrl.config import ConfigError
    from agentrl.recipe import load_run_config
    from agentrl.run_checks import check_names

    demo = Path(__file__).resolve().parents[1] / "examples" / "search_r1" / "config.yaml"
    tree = "rollout.tree={branch_at: [1], k: 2}"
    cfg = load_run_config(demo, [tree, "env.name=agentrl.testing.envs:SyntheticEnv"])
    with pytest.raises(
        ConfigError, match=r"^env\.name: env 'agentrl.testing.envs:SyntheticEnv' .*cannot branch"
    ):
        check_names(cfg)
    check_names(load_run_config(demo, [tree]))  # the search env forks


def _leaf(sample: int, path: list[int], reward: float) -> Trajectory:
    t = Trajectory("task0", "g0", [1, 2], sample_index=sample, reward=reward)
    t.append_model_tokens([5, 6], [-0.1, -0.2], 0, "search x")
    t.append_observation_tokens([7], "docs")
    t.append_model_tokens([8 + path[0]], [-0.3], 0, f"answer {path[0]}")
    t.tree = TreePosition(f"g0/{sample}", path, [1], [3])
    return t


def test_dumps_and_the_viewer_show_each_leaf_in_its_tree(chromium: str, tmp_path: Path) -> None:
    import asyncio
    import json

    from agentrl.episodes import episode_record, to_trajectory
    from agentrl.testing.browser import Chromium
    from agentrl.viewer import page_html

    leaves = [_leaf(0, [0], 1.0), _leaf(0, [1], 0.0), _leaf(1, [0], 0.0)]
    records = [json.loads(json.dumps(episode_record(t, "train", 1, trained=True))) for t in leaves]
    assert records[1]["tree"] == {"tree_id": "g0/0", "path": [1], "branch_turns": [1], "branch_offsets": [3]}
    assert to_trajectory(records[1]).tree == leaves[1].tree  # read back whole
    page = tmp_path / "view.html"
    page.write_text(page_html(records, None), encoding="utf-8")

    async def look() -> tuple[list[str], str, list[str], list[str]]:
        async with Chromium(executable=chromium) as b:
            await b.goto(page.as_uri())
            await b.wait_for("window.agentrlViewerReady")
            await b.evaluate("window.agentrlViewer.select(ROWS.findIndex(r => r[3] === 0 && r[13] === '1'))")
            listed = await b.evaluate(
                "[...document.querySelectorAll('.row span:nth-child(4)')].map(s => s.textContent)"
            )
            tree = await b.evaluate("document.getElementById('detail-tree').innerText")
            turns = await b.evaluate("[...document.querySelectorAll('#detail .turn')].map(t => t.className)")
            return listed, tree, turns, b.page_errors()

    listed, tree, turns, errors = asyncio.run(look())
    assert not errors
    assert listed == ["0 · 0", "0 · 1", "1 · 0"]
    assert "tree g0/0" in tree and "path 1" in tree and "after turns 1" in tree and "[1: 0.00]" in tree
    assert "0: 1.00" in tree
    # the first model turn and its observation are the shared prefix; the last turn is the leaf's own
    assert turns == ["turn assistant shared", "turn observation shared", "turn assistant"]


class SeededEngine(EngineClient):
    """Answers from (input ids, sampling seed) only, after a random delay (no server)."""

    def __init__(self, timing_seed: int) -> None:
        super().__init__("http://127.0.0.1:1")
        self.delays = random.Random(timing_seed)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *a: Any, **kw: Any
    ) -> GenerateResult:
        import asyncio

        await asyncio.sleep(self.delays.random() * 0.005)
        rng = random.Random(hash((tuple(input_ids), sampling.sampling_seed)))
        ids = [rng.randrange(10, 200) for _ in range(rng.randint(1, sampling.max_new_tokens))]
        return GenerateResult(ids, [-rng.random() for _ in ids], "stop", weight_version="0")


class CountingEnv(Env):
    """Three turns, forks by copy; reward: the parity of the last action's length."""

    scores_itself = True

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.turn = 0
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        if self.turn < 3:
            return StepResult(f"turn {self.turn}")
        return StepResult(reward=float(len(action_text) % 2), terminated=True)

    def fork(self) -> CountingEnv:
        return copy.copy(self)


async def _deterministic_batch(tok: Any, tree: dict[str, Any] | None, timing_seed: int) -> list[Trajectory]:
    config = cfg(group_size=2, batch_size=2, max_turns=3, tree=tree)
    orch = Orchestrator(config, SeededEngine(timing_seed), tok, CountingEnv, tasks(6), deterministic=True)
    await orch.start()
    try:
        return await orch.buffer.get_batch(timeout=30)
    finally:
        await orch.stop()


async def test_deterministic_trees_that_never_branch_sample_as_flat_episodes(tok):
    def view(batch: list[Trajectory]) -> list[tuple]:
        return sorted(
            (t.group_id, t.sample_index, t.response_ids, t.rollout_logprobs, t.reward) for t in batch
        )

    flat = await _deterministic_batch(tok, None, 0)
    unbranched = await _deterministic_batch(tok, {"branch_at": [1, 2], "k": 1}, 1)
    assert view(unbranched) == view(flat) and all(t.tree.path == [0, 0] for t in unbranched)
    # branching: the same trees whatever the timing, and children that go their own ways
    a = await _deterministic_batch(tok, {"branch_at": [1], "k": 2}, 2)
    b = await _deterministic_batch(tok, {"branch_at": [1], "k": 2}, 3)
    assert sorted((t.group_id, tuple(t.tree.path), t.response_ids) for t in a) == sorted(
        (t.group_id, tuple(t.tree.path), t.response_ids) for t in b
    )
    pairs: dict[str, list[Trajectory]] = {}
    for t in a:
        pairs.setdefault(t.tree.tree_id, []).append(t)
    assert any(x.response_ids != y.response_ids for x, y in pairs.values())


class FragileEnv(ForkingEnv):
    """Forks, but the fork of a task marked ``bad_fork`` fails, and a forked child of a task marked
    ``bad_child`` fails at its first step; every instance is kept, to check that all were closed."""

    made: list[FragileEnv] = []

    def __init__(self, **kw: Any) -> None:
        super().__init__(turns=3, **kw)
        self.task: dict[str, Any] = {}
        self.child = False
        FragileEnv.made.append(self)

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.task = task
        return await super().reset(task)

    def fork(self) -> FragileEnv:
        if self.task.get("bad_fork"):
            raise RuntimeError("snapshot failed")
        child = super().fork()
        child.child, child.closed = True, False
        FragileEnv.made.append(child)
        return child

    async def step(self, action_text: str) -> StepResult:
        if self.child and self.task.get("bad_child"):
            raise RuntimeError("child broke")
        return await super().step(action_text)


async def test_failed_forks_and_children_are_failed_leaves_and_every_env_is_closed(tok):
    FragileEnv.made = []
    marked = [{"prompt": "a", "bad_fork": True}, {"prompt": "b", "bad_child": True}, {"prompt": "c"}]
    config = cfg(
        group_size=1,
        batch_size=1,
        max_retries=0,
        failed_member_policy="drop_member",
        tree={"branch_at": [1], "k": 2},
    )
    async with stub_engine_in_process(min_tokens=2, max_tokens=6, seed=2) as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(config, client, tok, FragileEnv, marked)
        await orch.start()
        batches = [await orch.buffer.get_batch(timeout=30) for _ in range(2)]
        failed = orch.take_failed()
        stats = orch.stats()
        await orch.stop()
        await client.close()
    errors = sorted(t.error for t in failed)
    assert errors == ["env: RuntimeError: child broke", "env: RuntimeError: snapshot failed"], errors
    assert stats["rollout/tree_fork_failures"] == 1
    # the task whose fork failed lost its only leaf (dropped); the one with a broken child trains the
    # other leaf; the third trains both
    assert sorted(len(b) for b in batches) == [1, 2]
    assert stats["rollout/dropped_groups/failed:env"] == 1
    kept = [t for b in batches for t in b]
    assert all(t.status == Status.COMPLETED for t in kept)
    assert FragileEnv.made and all(env.closed for env in FragileEnv.made)


@pytest.mark.parametrize("interrupt_mode", ["continue", "restart"])
async def test_trees_through_weight_updates_stay_within_the_bound(tok, interrupt_mode):
    """Updates interrupt trees in flight: interrupted children resume (or their trees restart), every
    trained token stays within η, and every env is closed at the end."""
    FragileEnv.made = []
    config = cfg(max_staleness=0, interrupt_mode=interrupt_mode, over_sampling=2.0)
    async with stub_engine_in_process(min_tokens=2, max_tokens=8, per_token_time=0.002) as (engine, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(config, client, tok, FragileEnv, tasks(40))
        await orch.start()
        for _ in range(3):
            batch = await orch.buffer.get_batch(timeout=60)
            for t in batch:
                assert orch.version - t.min_policy_version <= 0 and t.status == Status.COMPLETED
            # the over-sampled groups go on generating; a request that reaches the engine from now on stays
            # there until an abort ends it, so the update has one to interrupt however slow the machine
            engine.cfg.base_latency = 3600.0
            engine.arrived.clear()
            await asyncio.wait_for(engine.arrived.wait(), timeout=30)
            interrupted = orch.stats(reset_window=False).get("rollout/interrupted_requests", 0)
            await orch.pause_for_update()
            assert orch.stats(reset_window=False).get("rollout/interrupted_requests", 0) > interrupted
            engine.cfg.base_latency = 0.0
            await client.update_weight_version(str(orch.version + 1))
            await orch.resume_after_update(orch.version + 1)
        stats = orch.stats()
        await orch.stop()
        await client.close()
    if interrupt_mode == "restart":
        assert stats["rollout/interrupt_restarts"] == stats["rollout/interrupted_requests"]
    else:
        assert stats.get("rollout/interrupt_restarts", 0) == 0
    assert all(env.closed for env in FragileEnv.made)


def test_shards_merge_the_prefix_cache_hit_rate_from_their_counts():
    from agentrl.rollout.shards import merge_stats

    def shard(cached: int, sent: int) -> dict[str, float]:
        rate = cached / sent
        return {
            "rollout/cached_input_tokens": cached,
            "rollout/request_input_tokens": sent,
            "rollout/prefix_cache_hit_rate": rate,
        }

    merged = merge_stats([shard(90, 100), shard(0, 300)])
    assert merged["rollout/prefix_cache_hit_rate"] == 90 / 400
