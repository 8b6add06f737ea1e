"""train_async.py: the main job. Asynchronous agentic RL, top to bottom in one file.

    python train_async.py                     # Search-R1 CPU demo (examples/search_r1/config.yaml)
    python train_async.py --config my.yaml rollout.group_size=8 trainer.lr=1e-5
    python train_async.py --resume            # continue from <output_dir>/checkpoints
    python train_async.py --ray-address auto  # an existing Ray cluster

The loop below is the same for every env and verifier: take a batch from the buffer, train, sync
weights to the engines (policy version + 1), log, evaluate and checkpoint at intervals. What a run does
around it comes from its recipe, the config's ``recipe`` key (agentrl.recipe): the model and tasks, the
servers the env needs, the held-out figures, the final plot and summary. The default config runs the
Search-R1 demo's recipe (agentrl.examples.search_r1.recipe: bootstrap, /retrieve server, exact match).

What runs where (Ray actors, agentrl.placement): the recipe's servers, inference engines (the embedded
engine, or SGLang servers), the rollout orchestrators (``rollout.shards`` async actors, each with its
staleness-bounded buffer, awaited as one: agentrl.rollout.shards) and the Megatron trainer (one actor per
rank). At the step's two hand-overs the GPU goes from the engines to the trainer and back with new weights
(agentrl.handover: colocated turns or overlap, or disaggregated).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.cli import config_module_names
from agentrl.cluster import start_ray, user_code_env
from agentrl.config import dump_config
from agentrl.episodes import EpisodeDump, episode_table
from agentrl.handover import Handover
from agentrl.host_memory import check_host_memory
from agentrl.metrics import MetricsLogger, ProgressLine, batch_metrics, engine_metrics, step_time_summary
from agentrl.node_watch import NodeLost, watch_nodes
from agentrl.placement import Fleet, check_cluster, run_network
from agentrl.recipe import describe_for_help, load_run_config, make_recipe, metric_label
from agentrl.run_checks import check_model_shape, check_names
from agentrl.run_config import RunConfig
from agentrl.trainer.checkpoint import latest_checkpoint, load_rollout_state, save_rollout_state
from agentrl.types import Trajectory

if TYPE_CHECKING:
    from agentrl.rollout.shards import RolloutGroup

DEFAULT_CONFIG = Path(__file__).resolve().parent / "examples" / "search_r1" / "config.yaml"


# ---- the run -------------------------------------------------------------------------------------------
async def main(cfg: RunConfig, resume: bool = False) -> dict[str, Any]:
    from agentrl.envs import make_env

    t_start = time.monotonic()
    check_names(cfg)  # env, verifier and tool names resolve (user code imports) before anything starts
    recipe, out = make_recipe(cfg), Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    ckpt_dir = out / "checkpoints"
    logger = MetricsLogger(out, cfg.metrics.tensorboard, cfg.metrics.wandb, cfg.model_dump(mode="json"))

    # 1. model and tasks, from the recipe (the Search-R1 demo: synthetic world, tiny model, SFT; cached)
    model_dir, train_tasks, eval_tasks = recipe.prepare()
    check_model_shape(cfg, model_dir)  # tp against the model's heads, before anything starts
    check_host_memory(cfg, model_dir)  # CPU Adam, offloads and engine backups fit this host's memory
    print(f"model {model_dir}; {len(train_tasks)} train / {len(eval_tasks)} held-out tasks", flush=True)

    # workers at the driver's priority, importing the user's modules from the working directory
    user_code = user_code_env(config_module_names(cfg), upload=cfg.ray.address is not None)
    start_ray(cfg.ray.address, cfg.ray.num_cpus, user_code)
    fleet, handover, lost_node = Fleet(cfg), None, False
    try:
        check_cluster(cfg)
        # servers on loopback, or on their node's address behind the run's secret when the cluster spans hosts
        fleet.network = recipe.network = run_network(cfg)
        # 2. the servers the env needs (the recipe's; the config's env.kwargs win),
        #    then engines, trainer, rollout
        env_kwargs = {**recipe.start_services(fleet.services), **cfg.env.kwargs}
        verifier = await check_verifier(cfg, env_kwargs)  # before the engines: fails if nothing scores
        env_factory = functools.partial(make_env, cfg.env.name, **env_kwargs)
        await fleet.start(model_dir, env_factory, train_tasks, verifier)
        trainer, rollout = fleet.trainer, fleet.rollout
        handover = Handover(cfg, trainer, rollout, fleet.control)
        retrain_info = {
            "trainer": fleet.trainer_config(model_dir).model_dump(mode="json"),
            "deterministic": cfg.deterministic,
            "max_staleness": cfg.rollout.max_staleness,
        }
        dump = EpisodeDump(
            out, cfg.rollout.dump, model_dir, retrain_info
        )  # rollout.dump: what agentrl.retrain needs
        evals: list[tuple[int, dict[str, float]]] = []  # (step, the recipe's held-out figures)
        evaluate = functools.partial(evaluation, recipe, rollout, eval_tasks, logger, dump, evals)

        # a node lost from here on ends the run at once, naming it and what ran there
        async with watch_nodes(fleet.placed):
            # 3. resume: trainer state, engine weights, rollout state (dataset cursor, tasks in flight)
            start_step, version = 0, 0
            if resume and latest_checkpoint(ckpt_dir) is not None:
                start_step, version = await load_checkpoint(fleet, ckpt_dir)
            await handover.start()  # colocated turns: the engines generate first, the trainer's state waits
            before = await evaluate(start_step) if cfg.eval.before else {}
            for key, value in before.items():
                print(f"held-out {metric_label(key)} before RL: {value:.3f}", flush=True)

            # 4. the loop: batch -> train -> sync weights (version + 1) -> log / eval / checkpoint
            await rollout.start()
            # the training batch's mean reward, new every step; the latest held-out figures follow it, marked
            shown = {
                "train_reward": "batch/reward",
                "stale": "batch/staleness_mean",
                "tok/s": "trainer/tokens_per_s",
            }
            progress = ProgressLine(cfg.steps, shown)
            for step in range(start_step, cfg.steps):
                stop_if_interrupted()
                t0 = time.monotonic()
                handover.batch_coming()  # colocated: the trainer's onload may start before the batch is in
                batch = await next_batch(rollout, step + 1, progress)
                t_wait = time.monotonic() - t0
                await handover.to_trainer()  # taking turns: generation pauses, the GPU goes to the trainer
                t_train = time.monotonic()
                dumped = cfg.rollout.dump.wants(step + 1)
                train_metrics = await trainer.train_step(batch, cfg.rollout.max_staleness, dumped)
                t_train = time.monotonic() - t_train
                failed = await rollout.take_failed() if cfg.rollout.dump.enabled else []
                if dumped:
                    await asyncio.to_thread(dump.train, step + 1, batch, await trainer.last_logprobs())
                    await asyncio.to_thread(dump.failed, step + 1, failed)
                version = await handover.to_engines()  # paused; new weights; the GPU back to the engines
                rollout_stats = await rollout.stats()  # while paused: with deterministic, a fixed point
                await rollout.resume_after_update(version)
                last = {
                    **batch_metrics(batch, version - 1),
                    **recipe.batch_metrics(batch),
                    **{f"trainer/{k}": v for k, v in train_metrics.items()},
                    **rollout_stats,
                    **(await engine_metrics(fleet.monitor)),
                    **handover.phases,
                    "time/wait_batch_s": t_wait,
                    "time/train_s": t_train,
                    "time/step_s": time.monotonic() - t0,
                    "policy_version": version,
                }
                if cfg.eval.interval and (step + 1) % cfg.eval.interval == 0 and step + 1 < cfg.steps:
                    last.update(await evaluate(step + 1))
                logger.log(last, step + 1)
                progress.update(step + 1, last, held_out=evals[-1] if evals else None)
                if cfg.checkpoint.due(step + 1):
                    await save_checkpoint(fleet, handover, ckpt_dir, step + 1)
            progress.close()
            if cfg.checkpoint.at_end and cfg.steps > start_step and not cfg.checkpoint.due(cfg.steps):
                # the last step, unless just saved
                await save_checkpoint(fleet, handover, ckpt_dir, cfg.steps)
            after = await evaluate(cfg.steps) if cfg.eval.after else {}
            accounting = await rollout.accounting()
    except NodeLost:
        lost_node = True  # its parts are gone: the shutdown waits on them briefly
        raise
    finally:
        # 5. shutdown: rollout, trainer, engines, servers, Ray -- also on Ctrl-C and errors
        if handover is not None:
            await handover.close()
        await fleet.stop(lost_node)
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


# ---- the loop's building blocks ------------------------------------------------------------------------
async def check_verifier(cfg: RunConfig, env_kwargs: dict[str, Any]) -> str | None:
    """The verifier of the run (``rollout.verifier``, else the env's own; None for an env that scores
    itself), resolved once, at load: the rollout's episodes get this name. A ConfigError naming the field
    when there is none or it is unknown."""
    from agentrl.envs import make_env
    from agentrl.rewards import resolve_verifier

    env = make_env(cfg.env.name, **env_kwargs)
    try:
        return resolve_verifier(
            cfg.rollout.verifier, env.verifier, f"env {cfg.env.name!r}", env.scores_itself
        )
    finally:
        await env.close()


async def evaluation(
    recipe: Any,
    rollout: RolloutGroup,
    tasks: list[dict[str, Any]],
    logger: MetricsLogger,
    dump: EpisodeDump,
    evals: list[tuple[int, dict[str, float]]],
    step: int,
) -> dict[str, float]:
    """The recipe's held-out figures of the policy after ``step`` steps (greedy, one sample a task),
    logged with a table of the episodes, and their dump (rollout.dump)."""
    if not tasks:
        return {}
    trajs = await rollout.evaluate(tasks)
    figures = recipe.eval_metrics(trajs)
    evals.append((step, figures))
    logger.log({**figures, "eval/num_tasks": len(trajs)}, step)
    logger.log_table("eval/episodes", *episode_table(trajs), step)
    await asyncio.to_thread(dump.evaluation, step, trajs)
    return figures


async def save_checkpoint(fleet: Fleet, handover: Handover, ckpt_dir: Path, step: int) -> None:
    """Rollout state first, then the trainer's (which moves ``latest`` last, atomically), with the
    trainer's state on its device for the save."""
    save_rollout_state(ckpt_dir, step, await fleet.rollout.state_dict())
    async with handover.trainer_resident():
        await fleet.trainer.save_checkpoint(str(ckpt_dir))


async def load_checkpoint(fleet: Fleet, ckpt_dir: Path) -> tuple[int, int]:
    """The trainer's state, the engines get its weights, then the rollout's state (dataset cursor, tasks
    in flight); returns the step and the policy version the run goes on from."""
    step = await fleet.trainer.load_checkpoint(str(ckpt_dir))
    version = await fleet.trainer.sync_weights(new_version=False)  # the version they were saved at
    await fleet.rollout.load_state_dict(load_rollout_state(ckpt_dir, step), version)
    print(f"resumed at step {step}, policy version {version}", flush=True)
    return step, version


async def next_batch(
    rollout: RolloutGroup, step: int, progress: ProgressLine | None = None, report_every: float = 60.0
) -> list[Trajectory]:
    """The next batch from the buffer; while it takes long, say why (groups dropped as zero-variance, the
    first error of each failure kind, as the progress line would at the step's end).
    A cancel (Ctrl-C) always ends it with CancelledError, even when the batch arrives at the same moment
    (``asyncio.wait_for`` of Python 3.11 returns the result then, and the run went on training)."""

    async def get() -> list[Trajectory]:
        return await rollout.get_batch()

    fut = asyncio.ensure_future(get())
    try:
        while True:
            done, _ = await asyncio.wait({fut}, timeout=report_every)
            if done:
                return fut.result()
            stats = await rollout.stats(reset_window=False)  # the step's own figures stay whole
            dropped = {
                k.rsplit("/", 1)[-1]: int(v)
                for k, v in stats.items()
                if k.startswith("rollout/dropped_groups/")
            }
            for note in progress.failure_notes(stats) if progress is not None else []:
                print(note, flush=True)
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


def parse_args(argv: list[str] | None = None) -> tuple[RunConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(
        description="agentrl: asynchronous agentic RL (Search-R1 demo by default)",
        epilog=describe_for_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML run config")
    p.add_argument("--resume", action="store_true", help="continue from <output_dir>/checkpoints/latest")
    p.add_argument("--ray-address", default=None, help="connect to an existing Ray cluster")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. rollout.group_size=8")
    args = p.parse_args(argv)
    overrides = list(args.overrides) + ([f"ray.address={args.ray_address}"] if args.ray_address else [])
    return load_run_config(args.config, overrides), args


if __name__ == "__main__":
    # what `agentrl train` runs too: the working directory on sys.path, the config parsed, main, exit codes
    from agentrl.cli import train

    train(sys.modules[__name__])
