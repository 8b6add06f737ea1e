"""train_async.py: the main job. Asynchronous agentic RL, top to bottom in one file.

    python train_async.py                                  # Search-R1 CPU demo (examples/search_r1/config.yaml)
    python train_async.py --config my.yaml rollout.group_size=8 trainer.lr=1e-5
    python train_async.py --resume                         # continue from <output_dir>/checkpoints
    python train_async.py --ray-address auto               # an existing Ray cluster

The loop below is the same for every env and verifier: take a batch from the buffer, train, sync
weights to the engines (policy version + 1), log, evaluate and checkpoint at intervals. What a run does
around it comes from its recipe, the config's ``recipe`` key (agentrl.recipe): the model and tasks, the
servers the env needs, the held-out figures, the final plot and summary. The default config runs the
Search-R1 demo's recipe (agentrl.examples.search_r1.recipe: bootstrap, /retrieve server, exact match).

What runs where (Ray actors): the recipe's servers, inference engines (the embedded engine, or SGLang
servers), the rollout orchestrator (async actor with the staleness-bounded buffer) and the Megatron
trainer (one actor per rank).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Any

from agentrl.cluster import start_ray, start_service, stop_all
from agentrl.config import ConfigError, dump_config
from agentrl.episodes import EpisodeDump, episode_table
from agentrl.metrics import MetricsLogger, ProgressLine
from agentrl.recipe import load_run_config, make_recipe, metric_label
from agentrl.run_config import RunConfig
from agentrl.trainer.ray_actor import TrainerGroup
from agentrl.types import Trajectory

DEFAULT_CONFIG = Path(__file__).resolve().parent / "examples" / "search_r1" / "config.yaml"


# ---- building blocks (each small; the loop is in main()) ---------------------------------------------
def start_engines(cfg: RunConfig, model_dir: str, services: list[Any]) -> list[str]:
    """Engine URLs: embedded engines or SGLang servers, each owned by a Ray actor; or external URLs."""
    import ray

    e = cfg.engine
    if e.backend == "external":
        return list(e.urls)
    urls = []
    extra = ["--mem-fraction", str(e.mem_fraction)] if e.mem_fraction else []
    if cfg.deterministic or cfg.trainer.true_on_policy:  # batch-invariant kernels: a request's bits do not
        extra += ["--batch-invariant"]  # depend on what else the engine batches or caches (nor do the trainer's)
    for i in range(e.num_engines):
        if e.backend == "embedded":
            from agentrl.embedded.server import start_embedded_server

            start = functools.partial(
                start_embedded_server,
                model_dir,
                device=e.device,
                dtype=e.dtype,
                api_key=e.api_key,
                max_batch_size=e.max_batch_size,
                extra_args=extra,
                log_file=str(Path(cfg.output_dir) / f"engine_{i}.log"),
            )
        else:
            from agentrl.engine.launcher import SGLangConfig, SGLangLauncher

            sg = (e.sglang or SGLangConfig(model_path=model_dir)).model_copy(
                update={
                    "model_path": model_dir,
                    "port": 0 if e.num_engines > 1 else (e.sglang.port if e.sglang else 30000),
                }
            )
            if cfg.colocation.engine_sleep:  # SGLang serves the release / resume endpoints only with it
                sg.extra_args = {**sg.extra_args, "enable-memory-saver": True}
            start = functools.partial(lambda c: SGLangLauncher(c).start(), sg)
        services.append(start_service(f"engine_{i}", start, num_gpus=e.gpus_per_engine or 0))
        urls.append(ray.get(services[-1].url.remote()))
    return urls


def check_gpus(cfg: RunConfig) -> None:
    """Fail now, naming the fields, when Ray has fewer GPUs than the engines and trainer reserve (Ray
    would otherwise wait forever for the missing ones)."""
    import ray

    need, have = cfg.gpus_needed(), float(ray.cluster_resources().get("GPU", 0))
    if need > have:
        raise ConfigError(
            f"the run reserves {need:g} GPUs (engine.num_engines x engine.gpus_per_engine + "
            f"trainer_world_size x trainer_gpus_per_rank) but Ray has {have:g}; lower those, or use "
            "placement: colocated to share one GPU"
        )


async def check_verifier(cfg: RunConfig, env_kwargs: dict[str, Any]) -> str | None:
    """The verifier of the run (``rollout.verifier``, else the env's own); a ConfigError naming the field
    when there is none or it is unknown. The rollout checks the same again when it starts."""
    from agentrl.envs import make_env
    from agentrl.rewards import resolve_verifier

    env = make_env(cfg.env.name, **env_kwargs)
    try:
        return resolve_verifier(
            cfg.rollout.verifier, env.verifier, f"env {cfg.env.name!r}", env.scores_itself
        )
    finally:
        await env.close()


def batch_metrics(batch: list[Trajectory], version: int) -> dict[str, float]:
    """The loop's own figures for a training batch (the recipe may add its own)."""
    rewards = [t.reward or 0.0 for t in batch]
    stale = [version - t.min_policy_version for t in batch if t.min_policy_version is not None]
    return {
        "batch/reward": sum(rewards) / max(1, len(rewards)),
        "batch/turns": sum(t.num_turns for t in batch) / max(1, len(batch)),
        "batch/response_tokens": sum(len(t.response_ids) for t in batch) / max(1, len(batch)),
        "batch/staleness_mean": sum(stale) / max(1, len(stale)),
        "batch/staleness_max": float(max(stale, default=0)),
    }


async def engine_memory(client: Any) -> dict[str, float]:
    """The engines' peak GPU memory (GiB, the largest over engines) as they report it in
    ``/get_server_info``, and their cumulative counters summed over engines (the embedded engine's: device
    busy seconds in all and by step kind, decode steps and rows, prefill steps, rows and tokens, cached
    tokens, slot copies); empty when none reports them."""
    try:
        infos = await client.server_info()
    except Exception:  # a metric is not worth failing a step for
        return {}
    peaks = [float(i["peak_gpu_mem_gb"]) for i in infos if isinstance(i.get("peak_gpu_mem_gb"), int | float)]
    out = {"engine/peak_gpu_mem_gb": max(peaks)} if peaks else {}
    counters = ("busy_s", "prefill_busy_s", "decode_busy_s", "decode_steps", "decode_rows", "prefill_steps",
                "prefill_rows", "prefill_tokens", "cached_tokens", "slot_copies")  # fmt: skip
    for key in counters:
        vals = [float(i[key]) for i in infos if isinstance(i.get(key), int | float)]
        if vals:
            out[f"engine/{key}"] = sum(vals)
    return out


def step_time_summary(history: list[dict[str, float]]) -> dict[str, float]:
    """Means over the run's steps of the step-time breakdown (every ``time/*`` figure: waiting for the
    batch, training, syncing, and when colocated the sleep / wake / offload phases inside them), the
    engines' idle fraction and generated tokens/s over the loop, and the peak GPU memory seen."""
    out: dict[str, float] = {}
    steps = [r for r in history if "time/step_s" in r]
    for key in sorted({k for r in steps for k in r if k.startswith("time/")}):
        vals = [r[key] for r in steps if key in r]
        out[f"mean_{key.removeprefix('time/')}"] = sum(vals) / len(vals)
    # the rollout's figures cover the window since the previous step: weight them by its length
    timed = [r for r in steps if "rollout/engine_idle_frac" in r]
    wall = sum(r["time/step_s"] for r in timed)
    if wall > 0:
        out["engine_idle_frac"] = sum(r["rollout/engine_idle_frac"] * r["time/step_s"] for r in timed) / wall
    busy = [r for r in steps if "engine/busy_s" in r]
    if len(busy) > 1:  # the engines' own device time (summed over engines) against the loop's wall time
        span = sum(r["time/step_s"] for r in busy[1:])
        delta = {k: busy[-1][k] - busy[0].get(k, 0.0) for k in busy[-1] if k.startswith("engine/")}
        out["engine_device_busy_frac"] = delta["engine/busy_s"] / span
        if delta.get("engine/decode_steps"):
            out["engine_decode_steps_per_step"] = delta["engine/decode_steps"] / (len(busy) - 1)
            out["engine_rows_per_decode_step"] = delta.get("engine/decode_rows", 0.0) / delta["engine/decode_steps"]
        out["engine_prefill_tokens_per_step"] = delta.get("engine/prefill_tokens", 0.0) / (len(busy) - 1)
        for kind in ("prefill", "decode"):  # where the engines' device time goes, per RL step
            if f"engine/{kind}_busy_s" in delta:
                out[f"engine_{kind}_busy_s_per_step"] = delta[f"engine/{kind}_busy_s"] / (len(busy) - 1)
        if delta.get("engine/prefill_steps"):
            out["engine_prefill_steps_per_step"] = delta["engine/prefill_steps"] / (len(busy) - 1)
    rated = [r for r in steps if "rollout/model_tokens_per_s" in r]
    wall = sum(r["time/step_s"] for r in rated)
    if wall > 0:  # the rollout's window is the step: tokens generated over the loop's wall time
        out["generated_tokens_per_s"] = sum(r["rollout/model_tokens_per_s"] * r["time/step_s"] for r in rated) / wall
    for key in ("trainer/peak_gpu_mem_gb", "engine/peak_gpu_mem_gb"):
        vals = [r[key] for r in history if key in r]
        if vals:
            out[key.replace("/", "_")] = max(vals)
    return out


# ---- the run -------------------------------------------------------------------------------------------
async def main(cfg: RunConfig, resume: bool = False) -> dict[str, Any]:
    from agentrl.engine.client import EngineClient
    from agentrl.envs import make_env
    from agentrl.rollout.ray_actor import OrchestratorSpec, make_rollout_actor

    t_start = time.monotonic()
    recipe = make_recipe(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    ckpt_dir = out / "checkpoints"
    logger = MetricsLogger(out, cfg.metrics.tensorboard, cfg.metrics.wandb, cfg.model_dump(mode="json"))

    # 1. model and tasks, from the recipe (the Search-R1 demo: synthetic world, tiny model, SFT; cached)
    model_dir, train_tasks, eval_tasks = recipe.prepare()
    print(f"model {model_dir}; {len(train_tasks)} train / {len(eval_tasks)} held-out tasks", flush=True)

    start_ray(cfg.ray.address, cfg.ray.num_cpus)  # workers at the driver's priority, not Ray's nice 15
    services: list[Any] = []
    trainer: TrainerGroup | None = None
    rollout: Any = None
    monitor: EngineClient | None = None  # the driver's own client, for engine metrics only
    control: EngineClient | None = None  # colocated: the engines' sleep and wake
    offloading: asyncio.Future[float] | None = None  # colocated: the trainer's offload, under way
    onloading: asyncio.Future[float] | None = None  # colocated: its onload, started ahead of the batch
    ahead = OnloadAhead(cfg.colocation.trainer_offload and cfg.colocation.trainer_onload_ahead)
    # engines and trainer take turns on one device (placement colocated), unless colocation.overlap lets
    # them share it at once, as disaggregated ones share nothing
    turns = cfg.placement == "colocated" and not cfg.colocation.overlap
    try:
        check_gpus(cfg)
        # 2. the servers the env needs (the recipe's; the config's env.kwargs win), then the engines
        env_kwargs = {**recipe.start_services(services), **cfg.env.kwargs}
        await check_verifier(cfg, env_kwargs)  # before the engines: a run nothing would score fails now
        engine_urls = start_engines(cfg, model_dir, services)
        monitor = EngineClient(
            engine_urls, api_key=cfg.engine.api_key, timeout=10, max_retries=0, router=cfg.engine.router
        )
        # weights go to every engine; behind a router (engine.router), to the workers it lists now
        sync_urls = await monitor.worker_urls()
        control = EngineClient(sync_urls, api_key=cfg.engine.api_key, timeout=300, max_retries=0)

        # 3. the trainer (one actor per rank) and the rollout orchestrator (async actor)
        trainer_cfg = cfg.trainer.model_copy(
            update={"model_path": model_dir, "seed": cfg.trainer.seed + cfg.seed, "deterministic": cfg.deterministic}
        )
        trainer = TrainerGroup(
            trainer_cfg, cfg.trainer_world_size, num_gpus_per_rank=cfg.trainer_gpus_per_rank or 0
        )
        # episode dumps (rollout.dump): what agentrl.replay needs to train a step again goes with them
        replay_info = {"trainer": trainer_cfg.model_dump(mode="json"), "max_staleness": cfg.rollout.max_staleness}
        dump = EpisodeDump(out, cfg.rollout.dump, model_dir, replay_info)
        rollout = make_rollout_actor(  # the orchestrator is built inside the actor, from this spec
            OrchestratorSpec(
                cfg.rollout.model_copy(  # run seed: task order (and request seeds when deterministic)
                    update={"seed": cfg.rollout.seed + cfg.seed, "deterministic": cfg.deterministic}
                ),
                engine_urls,
                model_dir,
                functools.partial(make_env, cfg.env.name, **env_kwargs),
                train_tasks,
                api_key=cfg.engine.api_key,
                router=cfg.engine.router,
            )
        )
        if cfg.weight_sync == "distributed":
            await asyncio.to_thread(trainer.init_weight_sync_group, sync_urls, len(sync_urls))

        # 4. resume: trainer state, rollout state (dataset cursor, tasks in flight), engine weights
        start_step, version = 0, 0
        if resume and (ckpt_dir / "latest").is_file():
            start_step = await asyncio.to_thread(trainer.load_checkpoint, str(ckpt_dir))
            version = await sync(cfg, trainer, sync_urls, out)  # engines get the checkpoint's weights
            state = pickle.loads((ckpt_dir / f"rollout_{start_step:08d}.pkl").read_bytes())
            await rollout.load_state_dict.remote(state, version)
            print(f"resumed at step {start_step}, policy version {version}", flush=True)

        if cfg.colocation.trainer_offload:  # the engines generate first: the trainer's state waits off the GPU
            await asyncio.to_thread(trainer.offload)

        evals: list[tuple[int, dict[str, float]]] = []  # (step, the recipe's held-out figures)

        async def evaluate(step: int) -> dict[str, float]:
            if not eval_tasks:
                return {}
            trajs = await rollout.evaluate.remote(eval_tasks)
            figures = recipe.eval_metrics(trajs)
            evals.append((step, figures))
            logger.log({**figures, "eval/num_tasks": len(trajs)}, step)
            logger.log_table("eval/episodes", *episode_table(trajs), step)
            await asyncio.to_thread(dump.evaluation, step, trajs)
            return figures

        before = await evaluate(start_step) if cfg.eval.before else {}
        for key, value in before.items():
            print(f"held-out {metric_label(key)} before RL: {value:.3f}", flush=True)

        # 5. the loop: batch -> train -> sync weights (version + 1) -> log / eval / checkpoint
        await rollout.start.remote()
        shown = {"reward": "batch/reward", **{k.rsplit("/", 1)[-1]: k for k in before}}
        progress = ProgressLine(
            cfg.steps, keys={**shown, "stale": "batch/staleness_mean", "tok/s": "trainer/tokens_per_s"}
        )
        for step in range(start_step, cfg.steps):
            stop_if_interrupted()
            t0 = time.monotonic()
            onloading = ahead.start(trainer, offloading)  # colocated: the onload, before the batch is in
            batch = await next_batch(rollout, step + 1)
            t_wait = time.monotonic() - t0
            ahead.now()  # the batch is in: an onload still waiting for its lead starts
            phases: dict[str, float] = {}  # colocated: sleep / wake / offload times
            if turns:  # one device, taken in turns: generation stops while the trainer runs
                await rollout.pause_for_update.remote()
                phases = await gpu_to_trainer(cfg, trainer, control, offloading, onloading)
                offloading = onloading = None
                ahead.observe(t_wait, phases)
            t_train = time.monotonic()
            train_metrics = await asyncio.to_thread(
                trainer.train_step, batch, cfg.rollout.max_staleness, cfg.rollout.dump.wants(step + 1)
            )
            t_train = time.monotonic() - t_train
            await asyncio.to_thread(dump.train, step + 1, batch, trainer)  # when rollout.dump wants it
            if not turns:  # generation went on beside the step; it pauses for the weight sync only
                await rollout.pause_for_update.remote()
            t1 = time.monotonic()
            if turns:
                version, offloading = await gpu_to_engines(cfg, trainer, control, sync_urls, out, phases)
            else:
                version = await _timed(phases, "weight_sync", sync(cfg, trainer, sync_urls, out))
            # while paused: with deterministic, a fixed point
            rollout_stats, sync_stats = await asyncio.gather(rollout.stats.remote(), weight_sync_parts(cfg, trainer))
            await rollout.resume_after_update.remote(version)
            last = {
                **batch_metrics(batch, version - 1),
                **recipe.batch_metrics(batch),
                **{f"trainer/{k}": v for k, v in train_metrics.items()},
                **rollout_stats,
                **(await engine_memory(monitor)),
                **sync_stats,
                "time/wait_batch_s": t_wait,
                "time/train_s": t_train,
                "time/sync_s": time.monotonic() - t1,
                "time/step_s": time.monotonic() - t0,
                **phases,
                "policy_version": version,
            }
            if cfg.eval.interval and (step + 1) % cfg.eval.interval == 0 and step + 1 < cfg.steps:
                last.update(await evaluate(step + 1))
            logger.log(last, step + 1)
            progress.update(step + 1, {**last, **(evals[-1][1] if evals else {})})
            if cfg.checkpoint.interval and (step + 1) % cfg.checkpoint.interval == 0:
                offloading = await settle(offloading)
                await checkpoint(trainer, rollout, ckpt_dir, step + 1, cfg.colocation.trainer_offload)
        progress.close()
        offloading = await settle(offloading)
        if cfg.steps > start_step:
            await checkpoint(trainer, rollout, ckpt_dir, cfg.steps, cfg.colocation.trainer_offload)

        after = await evaluate(cfg.steps) if cfg.eval.after else {}
        accounting = await rollout.accounting.remote()
    finally:
        # 6. shutdown: rollout, trainer, engines, servers, Ray -- also on Ctrl-C and errors
        await settle(offloading, quiet=True)
        await settle(onloading, quiet=True)
        if control is not None:
            await control.close()
        await shutdown(rollout, trainer, monitor, services)
        logger.close()

    result = {
        "eval_before": before,
        "eval_after": after,
        "steps": cfg.steps,
        "policy_version": version,
        "wall_s": time.monotonic() - t_start,
        **step_time_summary(logger.history),
        "accounting": accounting,
    }
    result = recipe.finish(result, logger.history, evals)  # the recipe's plot and summary table
    (out / "summary.json").write_text(json.dumps(result, indent=2, default=str))
    return result


async def shutdown(rollout: Any, trainer: TrainerGroup | None, monitor: Any, services: list[Any]) -> None:
    """Stop everything a run started, each part even when another fails. The trainer leaves the
    weight-sync group together with the engines (bounded), then the engines and servers stop."""
    import ray

    if rollout is not None:
        try:
            await asyncio.wait_for(rollout.stop.remote(), 60)
        except Exception as err:  # keep shutting the rest down
            print(f"rollout stop failed: {err}", file=sys.stderr)
    if trainer is not None:
        try:
            trainer.shutdown()
        except Exception as err:
            print(f"trainer shutdown failed: {err}", file=sys.stderr)
    if monitor is not None:
        await monitor.close()
    stop_all(services)
    ray.shutdown()


async def next_batch(rollout: Any, step: int, report_every: float = 60.0) -> list[Trajectory]:
    """The next batch from the buffer; while it takes long, say why (e.g. groups dropped as zero-variance).
    A cancel (Ctrl-C) always ends it with CancelledError, even when the batch arrives at the same moment
    (``asyncio.wait_for`` of Python 3.11 returns the result then, and the run went on training)."""

    async def get() -> list[Trajectory]:
        return await rollout.get_batch.remote()

    fut = asyncio.ensure_future(get())
    try:
        while True:
            done, _ = await asyncio.wait({fut}, timeout=report_every)
            if done:
                return fut.result()
            stats = await rollout.stats.remote(reset_window=False)  # the step's own figures stay whole
            dropped = {
                k.rsplit("/", 1)[-1]: int(v)
                for k, v in stats.items()
                if k.startswith("rollout/dropped_groups/")
            }
            print(
                f"step {step}: still waiting for a batch; groups dropped so far: {dropped or 'none'}",
                flush=True,
            )
    finally:
        fut.cancel()  # cancelled or failed: no request left behind (a no-op once the batch is in)


def stop_if_interrupted() -> None:
    """End the run as Ctrl-C asked when an await swallowed the cancel (this task was cancelled and did not
    stop): raise CancelledError here, between steps."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def sync(cfg: RunConfig, trainer: TrainerGroup, engine_urls: list[str], out: Path) -> int:
    """Push the trainer's weights to every engine; returns the new policy version."""
    if cfg.weight_sync == "distributed":
        return await asyncio.to_thread(trainer.sync_weights_distributed)
    if cfg.weight_sync == "tensor":
        return await asyncio.to_thread(trainer.sync_weights_from_tensor, engine_urls)
    return await asyncio.to_thread(trainer.sync_weights_from_disk, engine_urls, str(out / "weights"))


async def weight_sync_parts(cfg: RunConfig, trainer: TrainerGroup) -> dict[str, float]:
    """With weight_sync: tensor, where the last sync's seconds went: assembling the HF-named weights
    (``gather``), laying them into one buffer (``pack``) and the engines' call (``push``: mapping the
    handle, copying every parameter in place, answering)."""
    if cfg.weight_sync != "tensor":
        return {}
    stats = await asyncio.to_thread(trainer.last_sync_stats)
    if not stats:
        return {}
    return {
        "time/weight_sync_gather_s": stats["gather_seconds"],
        "time/weight_sync_pack_s": stats["pack_seconds"],
        "time/weight_sync_push_s": stats["seconds"] - stats["pack_seconds"],
    }


async def _timed(phases: dict[str, float], key: str, call: Any) -> Any:
    t0 = time.monotonic()
    result = await call
    phases[f"time/{key}_s"] = time.monotonic() - t0
    return result


async def gpu_to_trainer(
    cfg: RunConfig, trainer: TrainerGroup, control: Any, offloading: asyncio.Future[float] | None = None,
    onloading: asyncio.Future[float] | None = None,
) -> dict[str, float]:  # fmt: skip
    """Colocated, before a step (generation paused): the trainer's previous offload ends if it has not
    yet, then the engines release their KV cache and weights (colocation.engine_sleep) while the trainer
    takes its state back (colocation.trainer_offload), or finishes taking it back when the onload started
    ahead of the batch (``onloading``, see :class:`OnloadAhead`). The two overlap: the trainer's state
    beside an awake engine is how the run started (the engines sized their cache first, then the trainer
    was built on the GPU), so it fits; the step's activations come after."""
    phases: dict[str, float] = {}
    if offloading is not None:  # the last step's offload, overlapped with generation (gpu_to_engines)
        t0 = time.monotonic()
        phases["time/trainer_offload_s"] = await offloading
        phases["time/trainer_offload_wait_s"] = time.monotonic() - t0
    moves = []
    if cfg.colocation.engine_sleep:
        tags = ["kv_cache"] if cfg.colocation.engine_keep_weights else None  # None: weights and KV cache
        moves.append(_timed(phases, "engine_release", control.release_memory_occupation(tags)))
    if onloading is not None:  # under way since before the batch came: what is left of it
        moves.append(_onload_rest(phases, onloading))
    elif cfg.colocation.trainer_offload:
        moves.append(_timed(phases, "trainer_onload", asyncio.to_thread(trainer.onload)))
    t0 = time.monotonic()
    await asyncio.gather(*moves)
    if moves:
        phases["time/to_trainer_s"] = time.monotonic() - t0  # both, overlapped
    return phases


async def _onload_rest(phases: dict[str, float], onloading: asyncio.Future[float]) -> None:
    t0 = time.monotonic()
    phases["time/trainer_onload_s"] = await onloading
    phases["time/trainer_onload_wait_s"] = time.monotonic() - t0


class OnloadAhead:
    """When a colocated step's trainer onload starts (colocation.trainer_onload_ahead): before the batch is
    complete, so that the copy back to the GPU runs beside the last of the generation instead of after it.

    It starts ``lead`` seconds into the wait for the batch: the shortest of the last few waits less the
    longest of the last few onloads and a margin, so that it is done when a batch that comes as early as
    lately is in; a batch that comes earlier waits for the rest, and none waits longer than it would have
    with the onload after it. The trainer's state beside awake engines is how the run starts (the engines
    size their cache first, then the trainer is built on the GPU), so the two fit together; the step's
    activations come only after the engines released their memory. Until a step was measured, and when
    off, ``lead`` is None and the onload waits for the batch."""

    HISTORY = 5  # steps the lead is taken from
    MARGIN_S = 0.05  # the onload ends this long before the earliest recent batch

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.waits: list[float] = []
        self.onloads: list[float] = []
        self._go: asyncio.Event | None = None

    @property
    def lead(self) -> float | None:
        """Seconds into the wait at which the next onload starts (None: once the batch is in)."""
        if not (self.enabled and self.waits and self.onloads):
            return None
        return max(0.0, min(self.waits) - max(self.onloads) - self.MARGIN_S)

    def start(self, trainer: TrainerGroup, offloading: asyncio.Future[float] | None) -> asyncio.Future[float] | None:
        """At the start of the wait: the onload, under way (it returns its seconds), or None without a lead."""
        lead = self.lead
        if lead is None:
            return None
        self._go = asyncio.Event()
        return asyncio.ensure_future(self._onload(trainer, offloading, lead, self._go))

    def now(self) -> None:
        """The batch is in: an onload still waiting for its lead starts now."""
        if self._go is not None:
            self._go.set()
            self._go = None

    def observe(self, wait: float, phases: dict[str, float]) -> None:
        """A step's wait for its batch and its onload's own seconds (``time/trainer_onload_s``)."""
        if "time/trainer_onload_s" not in phases:
            return
        self.waits = [*self.waits, wait][-self.HISTORY :]
        self.onloads = [*self.onloads, phases["time/trainer_onload_s"]][-self.HISTORY :]

    @staticmethod
    async def _onload(
        trainer: TrainerGroup, offloading: asyncio.Future[float] | None, lead: float, go: asyncio.Event
    ) -> float:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(go.wait(), lead)
        if offloading is not None:
            await asyncio.shield(offloading)  # gpu_to_trainer reads its result too
        return await _seconds(asyncio.to_thread(trainer.onload))


async def gpu_to_engines(
    cfg: RunConfig, trainer: TrainerGroup, control: Any, engine_urls: list[str], out: Path,
    phases: dict[str, float],
) -> tuple[int, asyncio.Future[float] | None]:  # fmt: skip
    """Colocated, after a step, in slime's order: the engines take their weights back and get the new ones
    (version + 1); the trainer hands back its allocator's cache (the step's activations), and the engines
    take their KV cache back while the trainer moves its state off the GPU. That move overlaps the KV's
    return and the next generation, for the reason the onload overlaps the release (gpu_to_trainer); it
    is returned under way, and the next step's gpu_to_trainer (or a checkpoint) waits for it."""
    if cfg.colocation.engine_sleep and not cfg.colocation.engine_keep_weights:
        await _timed(phases, "engine_resume_weights", control.resume_memory_occupation(["weights"]))
    version = await _timed(phases, "weight_sync", sync(cfg, trainer, engine_urls, out))
    offloading = None
    if cfg.colocation.trainer_offload:
        await asyncio.to_thread(trainer.release_cached_memory)
        offloading = asyncio.ensure_future(_seconds(asyncio.to_thread(trainer.offload)))
    if cfg.colocation.engine_sleep:
        await _timed(phases, "engine_resume_kv", control.resume_memory_occupation(["kv_cache"]))
    return version, offloading


async def _seconds(call: Any) -> float:
    t0 = time.monotonic()
    await call
    return time.monotonic() - t0


async def settle(offloading: asyncio.Future[float] | None, quiet: bool = False) -> None:
    """Wait for a trainer offload under way (see gpu_to_engines); ``quiet``: on the way out, where its
    error must not hide the one being raised. Returns None, the new value of the caller's handle."""
    if offloading is None:
        return None
    try:
        await (asyncio.wait_for(offloading, 300) if quiet else offloading)
    except Exception as err:
        if not quiet:
            raise
        print(f"trainer offload failed: {err}", file=sys.stderr)
    return None


async def checkpoint(
    trainer: TrainerGroup, rollout: Any, ckpt_dir: Path, step: int, offloaded: bool = False
) -> None:
    """Rollout state first, then the trainer's (which moves ``latest`` last, atomically). ``offloaded``:
    the trainer's state is in host memory (colocation.trainer_offload) and comes back for the save."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = await rollout.state_dict.remote()
    (ckpt_dir / f"rollout_{step:08d}.pkl").write_bytes(pickle.dumps(state))
    if offloaded:
        await asyncio.to_thread(trainer.onload)
    await asyncio.to_thread(trainer.save_checkpoint, str(ckpt_dir))
    if offloaded:
        await asyncio.to_thread(trainer.offload)


def parse_args(argv: list[str] | None = None) -> tuple[RunConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description="agentrl: asynchronous agentic RL (Search-R1 demo by default)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML run config")
    p.add_argument("--resume", action="store_true", help="continue from <output_dir>/checkpoints/latest")
    p.add_argument("--ray-address", default=None, help="connect to an existing Ray cluster")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. rollout.group_size=8")
    args = p.parse_args(argv)
    overrides = list(args.overrides) + ([f"ray.address={args.ray_address}"] if args.ray_address else [])
    return load_run_config(args.config, overrides), args


if __name__ == "__main__":
    # Ctrl-C and a kill both give the clean shutdown, also when the job was started with SIGINT ignored
    # (a background job of a non-interactive shell inherits that, and then ran on to its last step)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    try:
        config, cli = parse_args()
    except ConfigError as err:
        sys.exit(str(err))
    try:
        asyncio.run(main(config, resume=cli.resume))
    except ConfigError as err:  # found once Ray is up (e.g. too few GPUs); everything was shut down
        sys.exit(str(err))
    except KeyboardInterrupt:
        sys.exit("interrupted: everything was shut down")
