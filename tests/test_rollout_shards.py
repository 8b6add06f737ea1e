"""Rollout shards (agentrl.rollout.shards): two orchestrators, in process, each driving a stub engine of
its own (real HTTP), behind one RolloutGroup: batches, evaluation order, merged figures and accounting,
checkpoint state; and the config checks of ``rollout.shards`` when a run's config loads."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from agentrl.config import ConfigError
from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.recipe import load_run_config
from agentrl.rollout import OrchestratorSpec, RolloutConfig, RolloutGroup, RolloutWorker, shard_specs
from agentrl.rollout.shards import merge_stats
from agentrl.testing.envs import SyntheticEnv
from agentrl.testing.stub_engine import stub_engine_in_process

# each stub engine samples from a token range of its own: a response token names the engine that made it
RANGES = [(3, 200), (300, 500)]


def _spec(urls: list[str], model_dir: Path, n_tasks: int = 24) -> OrchestratorSpec:
    cfg = RolloutConfig(
        group_size=2,
        batch_size=4,
        max_staleness=1,
        max_concurrency=9,
        max_turns=2,
        sampling=SamplingParams(max_new_tokens=8),
        filter_zero_variance=False,
        seed=5,
    )
    tasks = [{"prompt": f"q{i}", "id": i} for i in range(n_tasks)]
    return OrchestratorSpec(
        cfg, urls, str(model_dir), functools.partial(SyntheticEnv, turns=2), tasks, engine_timeout=30
    )


def test_one_shard_is_the_spec_itself(tiny_model_dir: Path) -> None:
    spec = _spec(["http://a", "http://b"], tiny_model_dir)
    assert shard_specs(spec, 1) == [spec]


def test_shards_split_config_engines_and_tasks(tiny_model_dir: Path) -> None:
    spec = _spec(["http://a", "http://b", "http://c", "http://d"], tiny_model_dir)
    specs = shard_specs(spec, 2)
    assert [s.engine_urls for s in specs] == [["http://a", "http://b"], ["http://c", "http://d"]]
    c0, c1 = (s.config for s in specs)
    assert (c0.batch_size, c0.max_concurrency, c0.seed) == (2, 5, 5)  # 9 episodes: the odd one to shard 0
    assert (c1.batch_size, c1.max_concurrency, c1.seed) == (2, 4, 6)
    assert c0.group_size == c1.group_size == 2 and c0.shards == c1.shards == 1
    drawn = [[s.dataset.next() for _ in range(12)] for s in specs]  # one whole pass of each shard's tasks
    assert sorted(d.task["id"] for d in drawn[0]) == list(range(0, 24, 2))
    assert sorted(d.task["id"] for d in drawn[1]) == list(range(1, 24, 2))
    assert all(d.uid.startswith(f"shard{i}/") for i in range(2) for d in drawn[i])
    with pytest.raises(ConfigError, match=r"rollout.shards"):
        shard_specs(spec, 3)  # 4 engines
    with pytest.raises(ConfigError, match=r"rollout.shards: 4 shards but only 3 training tasks"):
        shard_specs(_spec(["a", "b", "c", "d"], tiny_model_dir, n_tasks=3), 4)


@pytest.mark.timeout(120)
async def test_group_over_two_shards_with_engines_of_their_own(tiny_model_dir: Path) -> None:
    async with (
        stub_engine_in_process(vocab_low=RANGES[0][0], vocab_high=RANGES[0][1], max_tokens=6) as (e0, url0),
        stub_engine_in_process(vocab_low=RANGES[1][0], vocab_high=RANGES[1][1], max_tokens=6) as (e1, url1),
    ):
        group = RolloutGroup([RolloutWorker(s) for s in shard_specs(_spec([url0, url1], tiny_model_dir), 2)])
        await group.start()
        try:
            batch = await group.get_batch(timeout=60)
            assert len({t.group_id for t in batch}) == 4 and len(batch) == 8  # batch_size groups in all
            for pos, t in enumerate(batch):  # shard order: shard 0's two groups (its even tasks), then 1's
                shard = pos // 4
                assert int(t.task_id) % 2 == shard and t.group_id.startswith(f"shard{shard}/")
                low, high = RANGES[shard]
                model = [tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
                assert model and all(low <= tok < high or tok == 2 for tok in model)  # 2: the stub's eos

            await group.pause_for_update()
            for url in (url0, url1):
                client = EngineClient(url, timeout=10)
                await client.update_weight_version("1")
                await client.close()
            await group.resume_after_update(1)
            batch2 = await group.get_batch(timeout=60)
            assert len(batch2) == 8 and not {t.group_id for t in batch} & {t.group_id for t in batch2}

            await group.pause_for_update()  # nothing generates while the figures are read
            workers = group.shards
            one = [await w.call("stats", reset_window=False) for w in workers]
            merged = await group.stats()
            assert set(merged) == set(one[0]) | set(one[1]) | {
                f"rollout/shard{i}/{k}"
                for i in range(2)
                for k in ("loop_busy_frac", "loop_lag_ms_p90", "turns_per_s")
            }
            # each shard's requests went to its own engine only
            assert one[0]["rollout/requests"] == e0.counters["generate"] > 0
            assert one[1]["rollout/requests"] == e1.counters["generate"] > 0
            assert merged["rollout/requests"] == one[0]["rollout/requests"] + one[1]["rollout/requests"]
            assert merged["staleness/version"] == 1 and merged["buffer/batches"] == 2
            shard_busy = [merged[f"rollout/shard{i}/loop_busy_frac"] for i in range(2)]
            assert merged["rollout/loop_busy_frac"] == max(shard_busy)

            acc, parts = await group.accounting(), [await w.call("accounting") for w in workers]
            assert acc["balanced"] == 1 and acc["trained"] == 8
            assert acc == {**{k: parts[0][k] + parts[1][k] for k in acc}, "balanced": 1}

            state = await group.state_dict()
            assert len(state["shards"]) == 2
            assert [len(s["pending"]) for s in state["shards"]] == [p["in_flight"] for p in parts]
            await group.resume_after_update(1)  # evaluation generates
            evals = await group.evaluate([{"prompt": f"e{i}", "id": 100 + i} for i in range(5)])
            assert [t.task_id for t in evals] == [str(100 + i) for i in range(5)]
        finally:
            await group.stop()

        # the state goes back into a fresh group of two shards, and not into one of another count
        fresh = RolloutGroup([RolloutWorker(s) for s in shard_specs(_spec([url0, url1], tiny_model_dir), 2)])
        await fresh.load_state_dict(state, version=1)
        assert await fresh.state_dict() == state
        single = RolloutGroup([RolloutWorker(_spec([url0, url1], tiny_model_dir))])
        with pytest.raises(
            ConfigError, match=r"rollout.shards: the checkpoint's rollout state is of 2 shard"
        ):
            await single.load_state_dict(state, version=1)
        with pytest.raises(ConfigError, match=r"rollout.shards"):
            await fresh.load_state_dict(state["shards"][0], version=1)


def test_merge_stats_rule_per_key() -> None:
    a = {
        "rollout/turns_per_s": 100.0,
        "rollout/episodes": 10,
        "rollout/loop_busy_frac": 0.9,
        "rollout/loop_lag_ms_p90": 3.0,
        "rollout/episode_len_mean": 10.0,
        "rollout/generate_latency_mean_s": 1.0,
        "rollout/engine_idle_frac": 0.2,
        "rollout/tool_latency_mean_s": 0.0,  # no tool call in its window
        "rollout/dataset_epoch": 2,
        "buffer/batches": 3,
        "staleness/mean": 1.0,
        "staleness/hist_1": 4,
        "rollout/failures/env": 1,
    }
    b = {
        **a,
        "rollout/turns_per_s": 50.0,
        "rollout/loop_busy_frac": 0.5,
        "rollout/loop_lag_ms_p90": 7.0,
        "rollout/episode_len_mean": 20.0,
        "rollout/generate_latency_mean_s": 3.0,
        "rollout/engine_idle_frac": 0.4,
        "rollout/tool_latency_mean_s": 0.5,
        "rollout/dataset_epoch": 1,
        "staleness/mean": 0.0,
        "staleness/hist_0": 12,
        "staleness/hist_1": 0,
    }
    del b["rollout/failures/env"]
    out = merge_stats([a, b], [{"episodes": 1, "requests": 1}, {"episodes": 3, "requests": 0}])
    assert set(out) == set(a) | set(b) | {
        f"rollout/shard{i}/{k}"
        for i in range(2)
        for k in ("loop_busy_frac", "loop_lag_ms_p90", "turns_per_s")
    }
    assert out["rollout/turns_per_s"] == 150 and out["rollout/episodes"] == 20  # rates and counts: summed
    assert out["rollout/failures/env"] == 1  # a count one shard lacks is 0 there
    assert out["rollout/loop_busy_frac"] == 0.9 and out["rollout/loop_lag_ms_p90"] == 7.0  # the busiest loop
    assert out["rollout/shard1/loop_busy_frac"] == 0.5
    assert out["rollout/episode_len_mean"] == pytest.approx((10 * 1 + 20 * 3) / 4)  # by window episodes
    assert out["rollout/generate_latency_mean_s"] == 1.0  # by window requests
    assert out["staleness/mean"] == pytest.approx(4 / 16)  # by the staleness histograms
    assert out["rollout/engine_idle_frac"] == pytest.approx(0.3)
    assert out["rollout/tool_latency_mean_s"] == 0.5  # the shards that had a tool call
    assert out["rollout/dataset_epoch"] == 1 and out["buffer/batches"] == 3
    assert merge_stats([a]) == a  # one shard: its dict unchanged


BASE = ["model_path=/m", "data.path=/d", "env.name=math"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.shards=3"],
            "rollout.batch_size: 32 groups cannot be split evenly over rollout.shards = 3",
        ),
        (
            ["rollout.shards=2", "rollout.max_concurrency=10"],
            "rollout.max_concurrency: 10 episodes split over rollout.shards = 2 leave 5 a shard, fewer than "
            "rollout.group_size = 8",
        ),
        (
            ["rollout.shards=2", "engine.num_engines=3"],
            "engine.num_engines: 3 engines cannot be split evenly over rollout.shards = 2",
        ),
        (
            ["rollout.shards=2", "engine.backend=external", "engine.urls=[http://a,http://b,http://c]"],
            "engine.urls: 3 engines cannot be split evenly over rollout.shards = 2",
        ),
        (
            ["rollout.shards=2", "engine.backend=external", "engine.urls=[http://r]", "engine.router=true"],
            "rollout.shards: 2 shards need engines of their own, but engine.router",
        ),
        (["rollout.shards=0"], "rollout.shards"),
    ],
)
def test_bad_shards_name_the_fields(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, BASE + overrides)


def test_shards_that_split_evenly_load() -> None:
    cfg = load_run_config(None, [*BASE, "rollout.shards=2", "engine.num_engines=4"])
    assert cfg.rollout.shards == 2
    assert load_run_config(None, BASE).rollout.shards == 1


def test_each_shard_reserves_its_cpus_in_ray() -> None:
    import ray

    from agentrl.placement import check_cluster

    cfg = load_run_config(None, [*BASE, "rollout.shards=2", "engine.num_engines=2"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:  # a trainer rank and two shards: 3 CPUs
        with pytest.raises(ConfigError, match=r"reserves 3 CPUs .* rollout.shards = 2\) .* ray.num_cpus=3"):
            check_cluster(cfg)
        check_cluster(load_run_config(None, [*BASE, "engine.num_engines=2"]))  # one shard fits
    finally:
        ray.shutdown()
