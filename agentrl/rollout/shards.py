"""Rollout shards: N orchestrators, each in a process with an event loop of its own, behind one async surface.

One orchestrator runs every episode on one asyncio loop, and past about a thousand turns a second that loop,
not the engines, limits the rollout (``rollout/loop_busy_frac`` near 1). With ``rollout.shards`` = N the
rollout runs as N orchestrators (Ray actors in a run), each with a disjoint share of the work
(:func:`shard_specs`):

* engines: shard i drives engines i*k .. (i+1)*k-1, k = engines / N (contiguous blocks, so a shard's
  engines are neighbours: the same node when the engines fill nodes in order);
* tasks: the training tasks i, i+N, i+2N, ... (``tasks[i::N]``), drawn with uids ``shard<i>/...``
  (:class:`ShardCursor`: group ids stay unique in a batch);
* config: ``batch_size / N`` groups a batch, ``max_concurrency / N`` episodes in flight (the remainder to
  the first shards) and ``seed + i``, so each shard shuffles its tasks in an order of its own.

Each shard's staleness controller admits under its own ``(η + v + 1)·B/N``; the N bounds add up to the run's
``(η + v + 1)·B``, and every shard gets the same version at every update, so the staleness bound holds for
the whole batch as for each shard's part of it (agentrl.buffer owns the invariant).

:class:`RolloutGroup` is what the driver awaits: a batch is one batch of every shard, gathered at once and
put together in shard order; pause, resume, start and stop go to every shard at once; evaluation splits the
tasks and returns them in their order. N = 1 is exactly the single orchestrator: its config, tasks, seed,
figures and checkpoint state unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from agentrl.actor_group import ActorGroup
from agentrl.config import ConfigError
from agentrl.engine.types import SamplingParams
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.dataset import DatasetCursor, Draw
from agentrl.rollout.ray_actor import ACTOR_OPTIONS, OrchestratorSpec, RolloutWorker
from agentrl.types import Trajectory


def shard_config(cfg: RolloutConfig, index: int, shards: int) -> RolloutConfig:
    """Shard ``index``'s config of ``shards``: its share of the batch and the concurrency, ``seed + index``
    (``cfg`` itself when there is one shard)."""
    if shards == 1:
        return cfg
    cfg.check_shards()
    mc = cfg.max_concurrency // shards + int(index < cfg.max_concurrency % shards)
    update = {
        "shards": 1,
        "batch_size": cfg.batch_size // shards,
        "max_concurrency": mc,
        "seed": cfg.seed + index,
    }
    return cfg.model_copy(update=update)


class ShardCursor(DatasetCursor):
    """A shard's :class:`DatasetCursor`: its draws' uids start with ``shard<i>/``, so that groups of different
    shards never share a ``group_id`` in a batch (the trainer's advantages group by it) and their request
    seeds differ."""

    def __init__(self, tasks: Sequence[dict[str, Any]], index: int, cfg: RolloutConfig) -> None:
        super().__init__(tasks, shuffle=cfg.shuffle, seed=cfg.seed, epochs=cfg.epochs)
        self.prefix = f"shard{index}/"

    def next(self) -> Draw | None:
        draw = super().next()
        return None if draw is None else dataclasses.replace(draw, uid=self.prefix + draw.uid)


def shard_specs(spec: OrchestratorSpec, shards: int) -> list[OrchestratorSpec]:
    """The orchestrators of ``shards`` shards of ``spec``: each with its config (:func:`shard_config`), its
    engines and its slice of the tasks (the module docstring says which); ``[spec]`` for one shard."""
    if shards == 1:
        return [spec]
    urls = [spec.engine_urls] if isinstance(spec.engine_urls, str) else list(spec.engine_urls)
    if spec.router or len(urls) % shards:
        raise ConfigError(
            f"rollout.shards: {shards} shards need the engines split evenly among them; got {len(urls)} "
            f"engine URL(s){' behind a router' if spec.router else ''}"
        )
    tasks = list(spec.dataset)
    if len(tasks) < shards:
        raise ConfigError(f"rollout.shards: {shards} shards but only {len(tasks)} training tasks to split")
    k, configs = len(urls) // shards, [shard_config(spec.config, i, shards) for i in range(shards)]
    return [
        dataclasses.replace(
            spec,
            config=configs[i],
            engine_urls=urls[i * k : (i + 1) * k],
            dataset=ShardCursor(tasks[i::shards], i, configs[i]),
        )
        for i in range(shards)
    ]


# How stats() puts the shards' figures together, per key (every key not named here is a count or a
# per-second rate: summed).
MAX_KEYS = frozenset(
    {
        "rollout/loop_busy_frac",  # the busiest loop is the one that limits
        "rollout/loop_cpu_frac",
        "rollout/loop_lag_ms_p50",
        "rollout/loop_lag_ms_p90",
        "rollout/loop_lag_ms_max",
        "rollout/episode_len_max",
        "rollout/tool_latency_p90_s",  # the pooled p90 is at most the largest shard's
        "staleness/max",
        "staleness/version",  # the same on every shard
    }
)
MIN_KEYS = frozenset(
    {
        "rollout/dataset_epoch",  # the epoch every shard has reached
        "buffer/batches",  # a batch of the group is one of every shard
    }
)
MEAN_KEYS = frozenset({"rollout/engine_idle_frac"})  # every shard drives as many engines
MEAN_OF_REPORTED_KEYS = frozenset({"rollout/tool_latency_mean_s"})  # a shard with no tool call says 0
WEIGHTED_KEYS = {  # mean weighted by what each shard counted in the window
    "rollout/episode_len_mean": "episodes",
    "rollout/episode_turns_mean": "episodes",
    "rollout/generate_latency_mean_s": "requests",
    "staleness/mean": "staleness_samples",
}
SHARD_KEYS = ("rollout/loop_busy_frac", "rollout/loop_lag_ms_p90", "rollout/turns_per_s")  # also per shard


def merge_stats(
    stats: Sequence[dict[str, float]], weights: Sequence[dict[str, float]] | None = None
) -> dict[str, float]:
    """One dict of the shards' figures, with the keys one shard gives: counts and per-second rates summed;
    the event loops' load (busy and CPU fraction, lag percentiles), maxima, other percentiles and the
    version the maximum; the dataset epoch and ``buffer/batches`` the minimum; the engines' idle fraction
    the mean; a text (``rollout/first_error/...``) the first shard's; means weighted by what each shard
    counted in the window (``weights[i]``: ``episodes``, ``requests``; the staleness mean by the shard's
    histogram), the plain mean where nothing counts them (over the shards that report a value), the
    prefix-cache hit rate from the summed token counts. With one shard, its dict unchanged; with more,
    also ``rollout/shard{i}/...`` for the loop's busy fraction and lag p90 and the turns/s of every shard."""
    if len(stats) == 1:
        return dict(stats[0])
    weights = weights or [{} for _ in stats]
    weights = [
        {**w, "staleness_samples": sum(v for k, v in s.items() if k.startswith("staleness/hist_"))}
        for s, w in zip(stats, weights, strict=True)
    ]
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for s in stats for k in s):
        have = [(s[key], w) for s, w in zip(stats, weights, strict=True) if key in s]
        values = [v for v, _ in have]
        if isinstance(values[0], str):  # a text among the figures (the first error of a kind): the first
            out[key] = values[0]
        elif key in MAX_KEYS:
            out[key] = max(values)
        elif key in MIN_KEYS:
            out[key] = min(values)
        elif key in MEAN_KEYS:
            out[key] = sum(values) / len(values)
        elif key in MEAN_OF_REPORTED_KEYS:
            reported = [v for v in values if v]
            out[key] = sum(reported) / len(reported) if reported else 0.0
        elif key in WEIGHTED_KEYS:
            counts = [w.get(WEIGHTED_KEYS[key], 0.0) for _, w in have]
            total = sum(counts)
            out[key] = (
                sum(v * c for v, c in zip(values, counts, strict=True)) / total
                if total > 0
                else sum(values) / len(values)
            )
        else:
            out[key] = sum(values)
    if out.get("rollout/request_input_tokens") and "rollout/prefix_cache_hit_rate" in out:
        # a ratio of two counts: the ratio of the sums, not the sum of the ratios
        out["rollout/prefix_cache_hit_rate"] = (
            out["rollout/cached_input_tokens"] / out["rollout/request_input_tokens"]
        )
    for i, s in enumerate(stats):
        for key in SHARD_KEYS:
            if key in s:
                out[key.replace("rollout/", f"rollout/shard{i}/", 1)] = s[key]
    return out


class RolloutGroup:
    """The rollout the driver awaits: N shards (Ray actors of
    :class:`~agentrl.rollout.ray_actor.RolloutWorker`, or the workers themselves in process; ``shards``, their
    :class:`~agentrl.actor_group.ActorGroup`) as one; see the module docstring. The verbs are the
    orchestrator's, through the worker's ``call``; a shard's error is raised named by its rank."""

    def __init__(self, shards: Sequence[Any] | ActorGroup) -> None:
        if not shards:
            raise ValueError("a RolloutGroup needs at least one shard")
        self.shards = shards if isinstance(shards, ActorGroup) else ActorGroup(shards)
        self._window_base = [{"episodes": 0.0, "requests": 0.0} for _ in self.shards]

    @classmethod
    def spawn(cls, specs: Sequence[OrchestratorSpec], **ray_options: Any) -> RolloutGroup:
        """One Ray actor per orchestrator of ``specs`` (each built inside its actor); ``ray_options`` go to
        ``.options()``."""
        return cls(ActorGroup.spawn(RolloutWorker, [(s,) for s in specs], **{**ACTOR_OPTIONS, **ray_options}))

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    async def _all(self, verb: str, *args: Any) -> list[Any]:
        """``verb(*args)`` on every shard at once, results in shard order."""
        return await self.shards.all("call", verb, *args)

    async def _each(self, verb: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Shard i's ``verb(*args[i])``, all at once, results in shard order. The first error is raised,
        and the calls still running in this process are cancelled."""
        return await self.shards.each("call", [(verb, *a) for a in args])

    async def start(self) -> None:
        await self._all("start")

    async def locations(self) -> list[dict[str, Any]]:
        """Where each shard runs: its Ray node's id and address, and its pid (shard order)."""
        return await self.shards.all("location")

    async def stop(self) -> None:
        """Stop every shard, each even when another fails; then the first error is raised."""
        await self.shards.all_settled("stop")

    async def get_batch(
        self, num_groups: int | None = None, timeout: float | None = None
    ) -> list[Trajectory]:
        """One batch: every shard's next batch (``num_groups / N`` groups each when given), in shard order.
        A shard's :class:`~agentrl.buffer.NoProgressError` (or timeout) is raised as it is."""
        n = self.num_shards
        if num_groups is not None and num_groups % n:
            raise ValueError(f"num_groups: {num_groups} groups cannot be split over {n} rollout shards")
        per_shard = None if num_groups is None else num_groups // n
        parts = await self._all("buffer.get_batch", per_shard, timeout)
        return [t for part in parts for t in part]

    async def take_failed(self) -> list[Trajectory]:
        """Every shard's failed training episodes since the last take (for the episode dumps)."""
        parts = await self._all("take_failed")
        return [t for part in parts for t in part]

    async def pause_for_update(self) -> None:
        await self._all("pause_for_update")

    async def resume_after_update(self, version: int) -> None:
        await self._all("resume_after_update", version)

    async def evaluate(
        self, tasks: Sequence[dict[str, Any]], sampling: SamplingParams | None = None
    ) -> list[Trajectory]:
        """One episode per task, the tasks split over the shards (``tasks[i::N]``); returned in task order."""
        n = self.num_shards
        if n == 1:
            return await self.shards.rank0("call", "evaluate", tasks, sampling)
        tasks = list(tasks)
        parts = await self._each("evaluate", [(tasks[i::n], sampling) for i in range(n)])
        order = [i for shard in range(n) for i in range(shard, len(tasks), n)]  # task index of each result
        by_index = dict(zip(order, (t for part in parts for t in part), strict=True))
        return [by_index[i] for i in range(len(tasks))]

    async def stats(self, reset_window: bool = True) -> dict[str, float]:
        """Every shard's figures as one dict (:func:`merge_stats`: the rule per key); ``reset_window``
        starts a new window of rates and distributions on every shard."""
        stats = await self._all("stats", reset_window)
        counted = [self._counted(s) for s in stats]
        window = [
            {k: max(0.0, c[k] - base[k]) for k in c}
            for c, base in zip(counted, self._window_base, strict=True)
        ]
        if reset_window:
            self._window_base = counted
        return merge_stats(stats, window)

    @staticmethod
    def _counted(stats: dict[str, float]) -> dict[str, float]:
        """A shard's cumulative counts that weigh its windowed means (see :func:`merge_stats`)."""
        return {k: float(stats.get(f"rollout/{k}", 0.0)) for k in ("episodes", "requests")}

    async def accounting(self) -> dict[str, int]:
        """The shards' accounting summed (``balanced`` 1 only when every shard balances)."""
        parts = await self._all("accounting")
        if len(parts) == 1:
            return parts[0]
        out = {k: sum(p.get(k, 0) for p in parts) for k in dict.fromkeys(k for p in parts for k in p)}
        out["balanced"] = int(all(p.get("balanced", 0) for p in parts))
        return out

    async def state_dict(self) -> dict[str, Any]:
        """One shard: its state as it is; more: ``{"shards": [state of shard 0, ...]}``."""
        states = await self._all("state_dict")
        return states[0] if len(states) == 1 else {"shards": states}

    async def load_state_dict(self, state: dict[str, Any], version: int | None = None) -> None:
        """Restore before :meth:`start`; a ConfigError naming ``rollout.shards`` when the state was saved
        with another number of shards (each shard's cursor and tasks in flight are its own)."""
        saved = state["shards"] if "shards" in state else [state]
        if len(saved) != self.num_shards:
            raise ConfigError(
                f"rollout.shards: the checkpoint's rollout state is of {len(saved)} shard(s), this run has "
                f"{self.num_shards}; resume with rollout.shards={len(saved)}"
            )
        await self._each("load_state_dict", [(s, version) for s in saved])
        if self.num_shards > 1:  # the windows' counts go on from the loaded ones
            self._window_base = [self._counted(s) for s in await self._all("stats", False)]
