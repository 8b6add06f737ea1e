"""Where a run's parts run: the engines, the trainer ranks and the rollout as Ray actors, on which GPUs.

:class:`Fleet` starts them in order (the env's servers are the recipe's, started into the same list) and
stops them all, each part even when another fails, also on Ctrl-C and errors. Placement:

* disaggregated: Ray places each engine and each trainer rank on GPUs of its own
  (``engine.gpus_per_engine``, ``trainer_gpus_per_rank``).
* colocated on GPUs: one placement group with a bundle per GPU; engine i and trainer rank i share the
  bundle of GPU i (each half of it by default), as slime pairs them. Several GPUs are data parallel: N
  engines, N trainer ranks. Weights move within each GPU (CUDA IPC); sleep, wake and offload are per GPU.

Nodes: ``ray.engine_resources`` and ``ray.trainer_resources`` are custom Ray resources every engine actor
and every trainer rank asks for (colocated: every GPU's bundle holds both), so a cluster whose nodes declare
them (``ray start --resources``) takes the engines on some nodes and the trainer on others. Where each
actor ran is written to ``<output_dir>/placement.json`` (:meth:`Fleet.where`).

Every check that needs only the config ran when it loaded (agentrl.run_config); the ones here need Ray:
:func:`check_cluster` (the GPUs, the CPUs and the custom resources), before anything starts.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.actor_group import on_bundle
from agentrl.cluster import location, start_service, stop_all
from agentrl.config import ConfigError
from agentrl.run_config import RunConfig
from agentrl.weight_sync import WeightUpdate, trainer_env

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from agentrl.engine.client import EngineClient
    from agentrl.rollout.shards import RolloutGroup
    from agentrl.trainer.ray_actor import TrainerGroup

PLACEMENT_TIMEOUT_S = 60.0


TRAINER_CPUS_PER_RANK = 1.0  # what each trainer rank's actor reserves (agentrl.trainer.ray_actor)
ROLLOUT_CPUS = 1.0  # and each rollout shard's (agentrl.rollout.ray_actor, agentrl.rollout.shards)


def check_cluster(cfg: RunConfig) -> None:
    """Fail now, naming the fields, when Ray has fewer GPUs or CPUs than the engines, the trainer ranks and
    the rollout reserve, or not the custom resources they ask for (:func:`check_resources`): Ray would
    otherwise wait forever for what is missing, and the run would hang without a word."""
    import ray

    held = ray.cluster_resources()
    need, have = cfg.gpus_needed(), float(held.get("GPU", 0))
    if need > have:
        raise ConfigError(
            f"the run reserves {need:g} GPUs (engine.num_engines x engine.gpus_per_engine + "
            f"trainer_world_size x trainer_gpus_per_rank) but Ray has {have:g}; lower those, or use "
            "placement: colocated to share GPUs"
        )
    shards = cfg.rollout.shards
    need = cfg.trainer_world_size * TRAINER_CPUS_PER_RANK + shards * ROLLOUT_CPUS
    have = float(held.get("CPU", 0))
    if need > have:
        raise ConfigError(
            f"trainer_world_size: the run reserves {need:g} CPUs in Ray ({TRAINER_CPUS_PER_RANK:g} "
            f"per trainer rank, {ROLLOUT_CPUS:g} per rollout shard, rollout.shards = {shards}) "
            f"but Ray has {have:g}; set ray.num_cpus={need:g} (Ray's CPUs are logical: more than "
            "the machine's cores is fine) or start the cluster's nodes with more --num-cpus"
        )
    check_resources(cfg, ray.nodes())


def check_resources(cfg: RunConfig, nodes: list[dict[str, Any]]) -> None:
    """A ConfigError naming the field when the alive ``nodes`` (``ray.nodes()``) lack a custom resource of
    ``ray.engine_resources`` or ``ray.trainer_resources``: a name no node declares, less in all than the
    actors ask for together, or no node holding what one actor (colocated: one GPU's bundle) asks for."""
    r = cfg.ray
    engines = 0 if cfg.engine.backend == "external" else cfg.engine.num_engines
    asks = [
        ("ray.engine_resources", r.engine_resources, engines),
        ("ray.trainer_resources", r.trainer_resources, cfg.trainer_world_size),
    ]
    held = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    for field, ask, count in asks:
        for name, amount in ask.items():
            total = sum(float(h.get(name, 0)) for h in held)
            if total == 0:
                raise ConfigError(
                    f"{field}: no node of the Ray cluster has the resource "
                    f"{name!r}; start the nodes that should take these actors with "
                    f"ray start --resources '{{\"{name}\": {count * amount:g}}}'"
                )
            if count * amount > total:
                raise ConfigError(
                    f"{field}: {count} actors ask for {amount:g} {name!r} each, {count * amount:g} in all, "
                    f"but the Ray cluster's nodes have {total:g}"
                )
    per_actor = [(field, ask) for field, ask, _ in asks]
    if colocated_bundles(cfg):  # engine i and trainer rank i share a bundle: one node holds both asks
        per_actor = [("ray.engine_resources + ray.trainer_resources", _added(*(a for _, a in per_actor)))]
    for field, ask in per_actor:
        if ask and not any(all(float(h.get(k, 0)) >= v for k, v in ask.items()) for h in held):
            raise ConfigError(f"{field}: no node of the Ray cluster holds {ask}, what one actor asks for")


def _added(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}


def colocated_bundles(cfg: RunConfig) -> int:
    """GPUs a colocated run pairs engines and trainer ranks on (one bundle each); 0 when not colocated
    on GPUs (:meth:`~agentrl.run_config.RunConfig.colocated_on_gpus`)."""
    return cfg.trainer_world_size if cfg.colocated_on_gpus() else 0


def placement_group(
    num_gpus: int, cpus_per_bundle: float = 1.0, resources: dict[str, float] | None = None
) -> PlacementGroup:
    """A Ray placement group of ``num_gpus`` bundles of one GPU each (packed on as few nodes as can hold
    them), ready; a ConfigError when Ray cannot place it in time. ``resources``: the custom resources
    each bundle holds too (what the engine and the trainer rank placed on it ask for)."""
    import ray
    from ray.util.placement_group import placement_group as make_group

    bundle = {"GPU": 1, "CPU": cpus_per_bundle, **(resources or {})}
    group = make_group([bundle] * num_gpus, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        extra = f" and {resources} (ray.engine_resources + ray.trainer_resources)" if resources else ""
        raise ConfigError(
            f"placement colocated: Ray could not place {num_gpus} bundles of 1 GPU and "
            f"{cpus_per_bundle:g} CPU{extra} in {PLACEMENT_TIMEOUT_S:g} s "
            f"(trainer_world_size = {num_gpus}); lower it or add GPUs"
        )
    return group


def engine_starter(cfg: RunConfig, model_dir: str, index: int) -> Callable[[], Any]:
    """A picklable start of engine ``index``: the embedded engine, or an SGLang server with the flags the
    run needs (memory saver when colocated engines release memory, deterministic inference)."""
    e, exactness = cfg.engine, cfg.exactness
    if e.backend == "embedded":
        from agentrl.embedded.server import start_embedded_server

        extra = ["--mem-fraction", str(e.mem_fraction)] if e.mem_fraction else []
        if exactness.batch_invariant_engine:  # batch-invariant kernels: a request's bits do
            extra += ["--batch-invariant"]  # not depend on what else the engine batches (nor the trainer's)
        if cfg.trainer.lora is not None:  # adapters served as engine.lora_apply says, buffers of their rank
            extra += ["--lora-apply", e.lora_apply, "--max-lora-rank", str(cfg.trainer.lora.rank)]
        if e.quantization:  # fp8 weights, quantized again at every update (agentrl.embedded.fp8)
            extra += ["--quantization", e.quantization]
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
    from agentrl.engine.launcher import SGLangConfig, SGLangLoRAConfig

    releases = cfg.placement == "colocated" and cfg.colocation.engine_release != "none"
    lora = cfg.trainer.lora  # served by name beside the resident base (agentrl.weight_sync.named_adapters)
    sg = (e.sglang or SGLangConfig(model_path=model_dir)).model_copy(
        update={
            "model_path": model_dir,
            "port": 0 if e.num_engines > 1 else (e.sglang.port if e.sglang else 30000),
            "memory_saver": releases,  # SGLang serves the release / resume endpoints only with it
            "deterministic": exactness.deterministic_sglang,
            "quantization": e.quantization,  # and engine.quantization's
            "lora": None if lora is None else SGLangLoRAConfig.for_adapters(lora.rank, lora.target_modules),
        }
    )
    return functools.partial(_start_sglang, sg)


def describe_placement(placed: dict[str, Any]) -> str:
    """One line of :meth:`Fleet.where`: per node, the engines and trainer ranks on it."""
    nodes: dict[tuple[str, str], dict[str, list[int]]] = {}
    for kind in ("engines", "trainer_ranks"):
        for i, at in enumerate(placed[kind]):
            node = (str(at["node_id"])[:8], str(at["node_ip"]))
            nodes.setdefault(node, {}).setdefault(kind.replace("_", " "), []).append(i)
    parts = [
        f"node {nid} ({ip}): " + ", ".join(f"{kind} {ids}" for kind, ids in held.items())
        for (nid, ip), held in nodes.items()
    ]
    return "placement: " + "; ".join(parts)


def _start_sglang(sg: Any) -> Any:
    from agentrl.engine.launcher import SGLangLauncher

    return SGLangLauncher(sg).start()


class Fleet:
    """The actors of one run: the env's servers (the recipe starts them into ``services``), the engines,
    the trainer ranks and the rollout (``rollout``: a :class:`~agentrl.rollout.shards.RolloutGroup` of
    ``rollout.shards`` orchestrator actors), and the driver's two engine clients (``monitor`` for the
    engines' figures; ``control`` for release and resume, talking to every engine, behind a router too).
    :meth:`stop` stops whatever was started."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.services: list[Any] = []
        self.engines: list[Any] = []  # the engines' actors (also in services, which stops them)
        self.group: PlacementGroup | None = None  # colocated: the placement group, a bundle per GPU
        self.engine_urls: list[str] = []
        self.trainer: TrainerGroup | None = None
        self.rollout: RolloutGroup | None = None
        self.monitor: EngineClient | None = None
        self.control: EngineClient | None = None

    def trainer_config(self, model_dir: str) -> Any:
        """The trainer's config as the run gives it: the resolved model, the run's seed added to its own."""
        t = self.cfg.trainer
        return t.model_copy(update={"model_path": model_dir, "seed": t.seed + self.cfg.seed})

    async def start(
        self,
        model_dir: str,
        env_factory: Callable[[], Any],
        train_tasks: list[dict[str, Any]],
        verifier: str | None,
    ) -> None:
        """Engines, then the trainer ranks beside them, the rollout's shards (each an actor with its engines
        and tasks: agentrl.rollout.shards), and the weight-sync connection. ``verifier``: the run's, as
        resolved at load (None for an env that scores itself), which the shards' episodes use."""
        from agentrl.engine.client import EngineClient
        from agentrl.rollout.ray_actor import OrchestratorSpec
        from agentrl.rollout.shards import RolloutGroup, shard_specs
        from agentrl.trainer.ray_actor import TrainerGroup

        cfg, e = self.cfg, self.cfg.engine
        self.start_engines(model_dir)
        self.monitor = EngineClient(
            self.engine_urls, api_key=e.api_key, timeout=10, max_retries=0, router=e.router
        )
        # behind a router (engine.router): the workers it lists now
        sync_urls = await self.monitor.worker_urls()
        self.control = EngineClient(sync_urls, api_key=e.api_key, timeout=300, max_retries=0)
        self.trainer = TrainerGroup(
            self.trainer_config(model_dir),
            cfg.trainer_world_size,
            num_gpus_per_rank=cfg.trainer_gpus_per_rank or 0,
            num_cpus_per_rank=TRAINER_CPUS_PER_RANK,
            deterministic=cfg.deterministic,
            placement_group=self.group,  # rank i on bundle i: the GPU of engine i
            resources=cfg.ray.trainer_resources,
            env=trainer_env(e.backend),  # what the weight-update group with the engines needs
        )
        # the run's seed added: task order, and request seeds when deterministic
        rollout_cfg = cfg.rollout.model_copy(
            update={"seed": cfg.rollout.seed + cfg.seed, "verifier": verifier}
        )
        spec = OrchestratorSpec(
            rollout_cfg,
            self.engine_urls,
            model_dir,
            env_factory,
            train_tasks,
            api_key=e.api_key,
            router=e.router,
            deterministic=cfg.deterministic,
        )
        # each orchestrator is built inside its actor
        self.rollout = RolloutGroup.spawn(shard_specs(spec, cfg.rollout.shards), num_cpus=ROLLOUT_CPUS)
        weights = str(Path(cfg.output_dir) / "weights")
        await self.trainer.connect_engines(WeightUpdate(cfg.weight_sync, tuple(sync_urls), out_dir=weights))
        print(describe_placement(await self.where(Path(cfg.output_dir) / "placement.json")), flush=True)

    def start_engines(self, model_dir: str) -> list[str]:
        """The engines (or the external URLs), each engine in a Ray actor of its own, all starting at once
        (an engine's start, CUDA graphs included, takes about a minute on a GPU); colocated on GPUs,
        engine i on the bundle of GPU i. Returns their URLs once every engine is up."""
        import ray

        e, r = self.cfg.engine, self.cfg.ray
        bundles = colocated_bundles(self.cfg)
        if bundles and self.group is None:
            self.group = placement_group(bundles, resources=_added(r.engine_resources, r.trainer_resources))
        if e.backend == "external":
            self.engine_urls = list(e.urls)
        for i in range(0 if e.backend == "external" else e.num_engines):
            start, scheduling = engine_starter(self.cfg, model_dir, i), on_bundle(self.group, i)
            engine = start_service(
                f"engine_{i}",
                start,
                num_gpus=e.gpus_per_engine or 0,
                scheduling=scheduling,
                resources=r.engine_resources,
                wait=False,
            )
            self.services.append(engine)  # stopped by stop() even when another engine fails to start
            self.engines.append(engine)
        # the first failure surfaces here, with its server's log tail
        self.engine_urls += ray.get([engine.url.remote() for engine in self.engines])
        return self.engine_urls

    async def where(self, out: Path | None = None) -> dict[str, Any]:
        """Where the driver, each engine and each trainer rank run (Ray node id and IP, pid; written to
        ``out`` as JSON when given)."""
        placed = {
            "driver": location(),
            "engines": list(await asyncio.gather(*[a.location.remote() for a in self.engines])),
            "trainer_ranks": await self.trainer.locations() if self.trainer is not None else [],
        }
        if out is not None:
            out.write_text(json.dumps(placed, indent=2) + "\n")
        return placed

    async def stop(self) -> None:
        """Stop everything, each part even when another fails: the rollout, the trainer (it leaves the
        weight-sync group together with the engines, bounded), the clients, the engines and servers, Ray."""
        import ray

        if self.rollout is not None:
            try:
                await asyncio.wait_for(self.rollout.stop(), 60)
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
