"""Where a run's parts run: the engines, the trainer ranks and the rollout as Ray actors, on which GPUs.

:class:`Fleet` starts them in order (the env's servers are the recipe's, started into the same list) and
stops them all, each part even when another fails, also on Ctrl-C and errors. Placement:

* disaggregated: Ray places each engine and each trainer rank on GPUs of its own
  (``engine.gpus_per_engine``, ``trainer_gpus_per_rank``).
* colocated on GPUs: one placement group with a bundle per GPU; engine i and trainer rank i share the
  bundle of GPU i (each half of it by default), as slime pairs them. Several GPUs are data parallel: N
  engines, N trainer ranks. Weights move within each GPU (CUDA IPC); sleep, wake and offload are per GPU.

Every check that needs only the config ran when it loaded (agentrl.run_config); the ones here need Ray:
:func:`check_gpus`, before anything starts.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.cluster import start_service, stop_all
from agentrl.config import ConfigError
from agentrl.run_config import RunConfig

PLACEMENT_TIMEOUT_S = 60.0


def check_gpus(cfg: RunConfig) -> None:
    """Fail now, naming the fields, when Ray has fewer GPUs than the engines and trainer reserve (Ray
    would otherwise wait forever for the missing ones)."""
    import ray

    need, have = cfg.gpus_needed(), float(ray.cluster_resources().get("GPU", 0))
    if need > have:
        raise ConfigError(
            f"the run reserves {need:g} GPUs (engine.num_engines x engine.gpus_per_engine + "
            f"trainer_world_size x trainer_gpus_per_rank) but Ray has {have:g}; lower those, or use "
            "placement: colocated to share GPUs"
        )


def colocated_bundles(cfg: RunConfig) -> int:
    """GPUs a colocated run pairs engines and trainer ranks on (one bundle each); 0 when not colocated
    on GPUs."""
    if cfg.placement != "colocated" or not (cfg.trainer_gpus_per_rank and cfg.engine.gpus_per_engine):
        return 0
    return cfg.trainer_world_size


def placement_group(num_gpus: int, cpus_per_bundle: float = 1.0) -> Any:
    """A Ray placement group of ``num_gpus`` bundles of one GPU each (packed on as few nodes as can hold
    them), ready; a ConfigError when Ray cannot place it in time."""
    import ray
    from ray.util.placement_group import placement_group as make_group

    group = make_group([{"GPU": 1, "CPU": cpus_per_bundle}] * num_gpus, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ConfigError(
            f"placement colocated: Ray could not place {num_gpus} bundles of 1 GPU and {cpus_per_bundle:g} CPU "
            f"in {PLACEMENT_TIMEOUT_S:g} s (trainer_world_size = {num_gpus}); lower it or add GPUs"
        )
    return group


def on_bundle(group: Any, index: int) -> Any:
    """The Ray scheduling strategy of bundle ``index`` of ``group`` (None without a group)."""
    if group is None:
        return None
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)


def engine_starter(cfg: RunConfig, model_dir: str, index: int) -> Callable[[], Any]:
    """A picklable start of engine ``index``: the embedded engine, or an SGLang server with the flags the
    run needs (memory saver when colocated engines release memory, deterministic inference)."""
    e = cfg.engine
    if e.backend == "embedded":
        from agentrl.embedded.server import start_embedded_server

        extra = ["--mem-fraction", str(e.mem_fraction)] if e.mem_fraction else []
        if cfg.deterministic or cfg.trainer.true_on_policy:  # batch-invariant kernels: a request's bits do
            extra += ["--batch-invariant"]  # not depend on what else the engine batches (nor the trainer's)
        return functools.partial(
            start_embedded_server,
            model_dir,
            device=e.device,
            dtype=e.dtype,
            api_key=e.api_key,
            max_batch_size=e.max_batch_size,
            extra_args=extra,
            log_file=str(Path(cfg.output_dir) / f"engine_{index}.log"),
        )
    from agentrl.engine.launcher import SGLangConfig

    sg = (e.sglang or SGLangConfig(model_path=model_dir)).model_copy(
        update={
            "model_path": model_dir,
            "port": 0 if e.num_engines > 1 else (e.sglang.port if e.sglang else 30000),
        }
    )
    flags = dict(sg.extra_args)
    if cfg.placement == "colocated" and cfg.colocation.engine_release != "none":
        flags["enable-memory-saver"] = True  # SGLang serves the release / resume endpoints only with it
    if cfg.deterministic:
        flags["enable-deterministic-inference"] = True
    sg.extra_args = flags
    return functools.partial(_start_sglang, sg)


def _start_sglang(sg: Any) -> Any:
    from agentrl.engine.launcher import SGLangLauncher

    return SGLangLauncher(sg).start()


class Fleet:
    """The actors of one run: the env's servers (the recipe starts them into ``services``), the engines,
    the trainer ranks and the rollout orchestrator, and the driver's two engine clients (``monitor`` for
    the engines' figures; ``control`` for release and resume, talking to every engine, behind a router
    too). :meth:`stop` stops whatever was started."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.services: list[Any] = []
        self.group: Any = None  # colocated: the placement group, a bundle per GPU
        self.engine_urls: list[str] = []
        self.trainer: Any = None
        self.rollout: Any = None
        self.monitor: Any = None
        self.control: Any = None

    def trainer_config(self, model_dir: str) -> Any:
        """The trainer's config as the run gives it: the resolved model, the run's seed added to its own."""
        t = self.cfg.trainer
        return t.model_copy(update={"model_path": model_dir, "seed": t.seed + self.cfg.seed})

    async def start(
        self, model_dir: str, env_factory: Callable[[], Any], train_tasks: list[dict[str, Any]]
    ) -> None:
        """Engines, then the trainer ranks beside them, the rollout, and the weight-sync connection."""
        from agentrl.engine.client import EngineClient
        from agentrl.rollout.ray_actor import OrchestratorSpec, make_rollout_actor
        from agentrl.trainer.ray_actor import TrainerGroup

        cfg, e = self.cfg, self.cfg.engine
        bundles = colocated_bundles(cfg)
        self.start_engines(model_dir)
        self.monitor = EngineClient(
            self.engine_urls, api_key=e.api_key, timeout=10, max_retries=0, router=e.router
        )
        sync_urls = (
            await self.monitor.worker_urls()
        )  # behind a router (engine.router): the workers it lists now
        self.control = EngineClient(sync_urls, api_key=e.api_key, timeout=300, max_retries=0)
        self.trainer = TrainerGroup(
            self.trainer_config(model_dir),
            cfg.trainer_world_size,
            num_gpus_per_rank=cfg.trainer_gpus_per_rank or 0,
            deterministic=cfg.deterministic,
            placement_group=self.group,
            bundle_indices=list(range(bundles)) if bundles else None,
        )
        rollout_cfg = cfg.rollout.model_copy(
            update={"seed": cfg.rollout.seed + cfg.seed}
        )  # task order, seeds
        spec = OrchestratorSpec(
            rollout_cfg, self.engine_urls, model_dir, env_factory, train_tasks, api_key=e.api_key,
            router=e.router, deterministic=cfg.deterministic,
        )  # fmt: skip
        self.rollout = make_rollout_actor(spec)  # the orchestrator is built inside the actor, from this spec
        await self.trainer.connect_engines(
            cfg.weight_sync,
            sync_urls,
            out_dir=str(Path(cfg.output_dir) / "weights"),
            num_engine_ranks=len(sync_urls),
        )

    def start_engines(self, model_dir: str) -> list[str]:
        """The engines (or the external URLs), each engine in a Ray actor of its own; colocated on GPUs,
        engine i on the bundle of GPU i. Returns their URLs."""
        import ray

        e = self.cfg.engine
        bundles = colocated_bundles(self.cfg)
        if bundles and self.group is None:
            self.group = placement_group(bundles)
        if e.backend == "external":
            self.engine_urls = list(e.urls)
        for i in range(0 if e.backend == "external" else e.num_engines):
            start, scheduling = engine_starter(self.cfg, model_dir, i), on_bundle(self.group, i)
            self.services.append(
                start_service(f"engine_{i}", start, num_gpus=e.gpus_per_engine or 0, scheduling=scheduling)
            )
            self.engine_urls.append(ray.get(self.services[-1].url.remote()))
        return self.engine_urls

    async def stop(self) -> None:
        """Stop everything, each part even when another fails: the rollout, the trainer (it leaves the
        weight-sync group together with the engines, bounded), the clients, the engines and servers, Ray."""
        import ray

        if self.rollout is not None:
            try:
                await asyncio.wait_for(self.rollout.stop.remote(), 60)
            except Exception as err:  # keep shutting the rest down
                print(f"rollout stop failed: {err}", file=sys.stderr)
        if self.trainer is not None:
            try:
                await self.trainer.shutdown()
            except Exception as err:
                print(f"trainer shutdown failed: {err}", file=sys.stderr)
        for client in (self.control, self.monitor):
            if client is not None:
                await client.close()
        stop_all(self.services)
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
        ray.shutdown()
