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
import secrets
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from agentrl.actor_group import on_bundle
from agentrl.cluster import (
    Network,
    is_loopback,
    location,
    node_ips,
    open_network,
    start_service,
    stop_all,
)
from agentrl.config import ConfigError
from agentrl.rollout.lockstep import seed_hash
from agentrl.run_config import RunConfig
from agentrl.weight_sync import IN_MEMORY, WeightUpdate, trainer_env

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


def run_network(cfg: RunConfig) -> Network:
    """Where the run's servers listen and the key they require (:func:`agentrl.cluster.open_network` over
    the Ray cluster's nodes, ``ray.listen``, ``engine.api_key``); said in one line when off loopback."""
    import ray

    nodes = ray.nodes()
    network = open_network(cfg.ray.listen, nodes, cfg.engine.api_key)
    if network.spans_hosts:
        print(
            f"servers listen on their node's address ({', '.join(node_ips(nodes))}), each requiring the "
            "run's secret",
            flush=True,
        )
    return network


def check_resources(cfg: RunConfig, nodes: list[dict[str, Any]]) -> None:
    """A ConfigError naming the field when the alive ``nodes`` (``ray.nodes()``) lack a custom resource of
    ``ray.engine_resources`` or ``ray.trainer_resources``: a name no node declares, less in all than the
    actors ask for together, or no node holding what one actor (colocated: one GPU's bundle) asks for."""
    r = cfg.ray
    engines = 0 if cfg.engine.backend == "external" else cfg.engine.num_engines
    asks = [
        ("ray.engine_resources", r.engine_resources, engines),
        ("ray.trainer_resources", r.trainer_resources, cfg.trainer_world_size),
        ("ray.rollout_resources", r.rollout_resources, cfg.rollout.shards),
        ("ray.service_resources", r.service_resources, 1),  # the recipe's servers: one at least
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
        pair = ("ray.engine_resources + ray.trainer_resources", _added(asks[0][1], asks[1][1]))
        per_actor = [pair, *per_actor[2:]]
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


def engine_seed(seed: int, index: int) -> int:
    """Engine ``index``'s seed of unseeded sampling in a run of ``seed``: a 63-bit hash of both."""
    return seed_hash(seed, "engine", index)


def engine_starter(
    cfg: RunConfig, model_dir: str, index: int, network: Network | None = None
) -> Callable[[], Any]:
    """A picklable start of engine ``index``: the embedded engine, or an SGLang server with the flags the
    run needs (memory saver when colocated engines release memory, deterministic inference), listening
    where the run's ``network`` says (default: loopback, with ``engine.api_key``)."""
    network = network or Network(secret=cfg.engine.api_key)
    e, exactness = cfg.engine, cfg.exactness
    if e.backend == "embedded":
        from agentrl.embedded.launch import start_embedded_server

        # requests without a sampling_seed take seeds from the engine's generator: one of its own per
        # engine, or a group's samples spread over the engines would draw alike
        extra = ["--seed", str(engine_seed(cfg.seed, index))]
        extra += ["--mem-fraction", str(e.mem_fraction)] if e.mem_fraction else []
        if exactness.batch_invariant_engine:  # batch-invariant kernels: a request's bits do
            extra += ["--batch-invariant"]  # not depend on what else the engine batches (nor the trainer's)
        if cfg.trainer.lora is not None:  # adapters served as engine.lora_apply says, buffers of their rank
            extra += ["--lora-apply", e.lora_apply, "--max-lora-rank", str(cfg.trainer.lora.rank)]
        if e.quantization:  # fp8 weights, quantized again at every update (agentrl.embedded.fp8)
            extra += ["--quantization", e.quantization]
        if (spec := e.speculative) is not None:  # drafts from the context (agentrl.embedded.speculative)
            extra += ["--speculative", spec.method, "--spec-k", str(spec.num_draft_tokens)]
            extra += ["--spec-ngram", str(spec.max_ngram), "--spec-min-ngram", str(spec.min_ngram)]
            extra += ["--spec-shared-tokens", str(spec.shared_tokens)]
            extra += ["--spec-acceptance", spec.acceptance]
            extra += [] if spec.adaptive else ["--spec-always"]
        return functools.partial(
            start_embedded_server,
            model_dir,
            host=network.host,
            device=e.device,
            dtype=e.dtype,
            api_key=network.secret,
            max_batch_size=e.max_batch_size,
            extra_args=extra,
            log_file=str(Path(cfg.output_dir) / f"engine_{index}.log"),
        )
    from agentrl.engine.sglang_config import SGLangConfig, SGLangLoRAConfig

    releases = cfg.placement == "colocated" and cfg.colocation.engine_release != "none"
    lora = cfg.trainer.lora  # served by name beside the resident base (agentrl.weight_sync.named_adapters)
    sg = e.sglang or SGLangConfig(model_path=model_dir)
    listen: dict[str, Any] = {"host": network.host} if network.spans_hosts else {}
    if network.secret:  # the run's key, which every client of the engines sends
        listen["api_key"] = network.secret
    sg = sg.model_copy(
        update={
            **listen,
            "model_path": model_dir,
            "port": 0 if e.num_engines > 1 else (e.sglang.port if e.sglang else 30000),
            "memory_saver": releases,  # SGLang serves the release / resume endpoints only with it
            "deterministic": exactness.deterministic_sglang,
            "quantization": e.quantization,  # and engine.quantization's
            "return_routed_experts": cfg.rollout.return_routed_experts,  # what routing replay trains with
            "lora": None if lora is None else SGLangLoRAConfig.for_adapters(lora.rank, lora.target_modules),
        }
    )
    return functools.partial(_start_sglang, sg)


def loopback_across_nodes(placed: dict[str, Any]) -> str | None:
    """What is wrong when a placement record (:meth:`Fleet.where`) hands a loopback URL to another host: an
    engine's to the driver, a trainer rank or a rollout shard on a node of another address, or a recipe
    server's to a rollout shard (the envs' client) so placed; None when every URL is reachable where it
    is used. Nodes of one address are one host: they share its loopback."""
    driver = placed.get("driver", {})
    users = {"engines": [driver, *placed["trainer_ranks"], *placed["rollout_shards"]]}
    users["services"] = placed["rollout_shards"]
    for kind in ("engines", "services"):
        for i, server in enumerate(placed.get(kind, [])):
            url = server.get("url")
            host = urlsplit(url).hostname if url else None
            if not host or not is_loopback(host):
                continue
            elsewhere = {str(u["node_id"])[:8] for u in users[kind] if u.get("node_ip") != server["node_ip"]}
            if elsewhere:
                name = server.get("name") or f"engine {i}"
                where = f"node {str(server['node_id'])[:8]}, {server['node_ip']}"
                return f"{name} at {url} ({where}) is used from node {', '.join(sorted(elsewhere))}"
    return None


def in_memory_across_hosts(placed: dict[str, Any]) -> str | None:
    """Which engine sits on another host than the trainer rank that hands it its weights in memory
    (engine j takes rank ``j % world_size``'s: :func:`agentrl.weight_sync.route`); None when none does."""
    ranks = placed["trainer_ranks"]
    for j, engine in enumerate(placed["engines"]):
        rank = ranks[j % len(ranks)] if ranks else engine
        if rank["node_ip"] != engine["node_ip"]:
            return (
                f"engine {j} runs on {engine['node_ip']} and trainer rank {j % len(ranks)} on "
                f"{rank['node_ip']}; use distributed"
            )
    return None


async def on_node(node_id: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run as a Ray task on the node ``node_id`` (taking no CPU of the run's)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    where = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return await ray.remote(fn).options(num_cpus=0, scheduling_strategy=where).remote(*args)


async def check_shared_dir(
    path: Path, placed: dict[str, Any], run_on: Callable[..., Awaitable[Any]] = on_node
) -> None:
    """A ConfigError naming ``weight_sync`` unless every engine's node sees the files trainer rank 0
    writes under ``path`` (weight_sync disk: the engines load the dir it writes): a marker written on rank
    0's node is read back on each engine's node (``run_on(node, fn, *args)``: :func:`on_node`)."""
    writer = placed["trainer_ranks"][0]["node_id"]
    readers = sorted({e["node_id"] for e in placed["engines"]} - {writer, None})
    if writer is None or not readers:
        return
    marker, token = path.absolute() / ".shared", secrets.token_hex(8)
    await run_on(writer, _write_marker, str(marker), token)
    seen = await asyncio.gather(*[run_on(n, _read_marker, str(marker)) for n in readers])
    blind = [n[:8] for n, text in zip(readers, seen, strict=True) if text != token]
    if blind:
        raise ConfigError(
            f"weight_sync: disk writes the weights under {path} on trainer rank 0's node, which the "
            f"engines' node {', '.join(blind)} does not see; use distributed, or put output_dir on a file "
            "system every node mounts"
        )


def _write_marker(path: str, token: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(token)


def _read_marker(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


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

    def __init__(self, cfg: RunConfig, network: Network | None = None) -> None:
        self.cfg = cfg
        # where the servers listen and the key they require (open_network, once Ray is up)
        self.network = network or Network(secret=cfg.engine.api_key)
        self.services: list[Any] = []
        self.engines: list[Any] = []  # the engines' actors (also in services, which stops them)
        self.group: PlacementGroup | None = None  # colocated: the placement group, a bundle per GPU
        self.engine_urls: list[str] = []
        self.placed: dict[str, Any] = {}  # where every part runs, once started (where)
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
        """Engines and the trainer ranks beside them, the rollout's shards (each an actor with its engines
        and tasks: agentrl.rollout.shards), and the weight-sync connection. ``verifier``: the run's, as
        resolved at load (None for an env that scores itself), which the shards' episodes use.

        The trainer ranks start while the engines do, unless they share GPUs with them (colocated on
        GPUs): an engine sizes its KV cache from the memory its GPU has free, so there the ranks wait."""
        from agentrl.engine.client import EngineClient
        from agentrl.rollout.ray_actor import OrchestratorSpec
        from agentrl.rollout.shards import RolloutGroup, shard_specs

        cfg, e, key = self.cfg, self.cfg.engine, self.network.secret
        self.spawn_engines(model_dir)
        if not colocated_bundles(cfg):
            self.start_trainer(model_dir)
        self.wait_engines()
        await self.check_reachable(await self.where())  # the engines, from the driver
        self.monitor = EngineClient(self.engine_urls, api_key=key, timeout=10, max_retries=0, router=e.router)
        # behind a router (engine.router): the workers it lists now
        sync_urls = await self.monitor.worker_urls()
        self.control = EngineClient(sync_urls, api_key=key, timeout=300, max_retries=0)
        if self.trainer is None:
            self.start_trainer(model_dir)
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
            api_key=key,
            router=e.router,
            deterministic=cfg.deterministic,
        )
        # each orchestrator is built inside its actor
        self.rollout = RolloutGroup.spawn(
            shard_specs(spec, cfg.rollout.shards),
            num_cpus=ROLLOUT_CPUS,
            resources=cfg.ray.rollout_resources,
        )
        self.placed = placed = await self.where(Path(cfg.output_dir) / "placement.json")
        await self.check_reachable(placed)  # every URL from every node that uses it
        weights = Path(cfg.output_dir) / "weights"
        if cfg.weight_sync == "disk":
            await check_shared_dir(weights, placed)
        if cfg.weight_sync in IN_MEMORY and (apart := in_memory_across_hosts(placed)):
            raise ConfigError(f"weight_sync: {cfg.weight_sync} hands weights over in memory, but {apart}")
        update = WeightUpdate(cfg.weight_sync, tuple(sync_urls), out_dir=str(weights), api_key=key)
        await self.trainer.connect_engines(update)
        print(describe_placement(placed), flush=True)

    def start_trainer(self, model_dir: str) -> None:
        """The trainer's ranks, each in a Ray actor; returns once every rank has built its model."""
        from agentrl.trainer.ray_actor import TrainerGroup

        cfg = self.cfg
        self.trainer = TrainerGroup(
            self.trainer_config(model_dir),
            cfg.trainer_world_size,
            num_gpus_per_rank=cfg.trainer_gpus_per_rank or 0,
            num_cpus_per_rank=TRAINER_CPUS_PER_RANK,
            master_addr=None if self.network.spans_hosts else "127.0.0.1",
            deterministic=cfg.deterministic,
            placement_group=self.group,  # rank i on bundle i: the GPU of engine i
            resources=cfg.ray.trainer_resources,
            env=trainer_env(cfg.engine.backend),  # what the weight-update group with the engines needs
        )

    def start_engines(self, model_dir: str) -> list[str]:
        """The engines (or the external URLs), each engine in a Ray actor of its own, all starting at once
        (an engine's start, CUDA graphs included, takes about a minute on a GPU); colocated on GPUs,
        engine i on the bundle of GPU i. Returns their URLs once every engine is up."""
        self.spawn_engines(model_dir)
        return self.wait_engines()

    def wait_engines(self) -> list[str]:
        """The URLs of the engines :meth:`spawn_engines` started (and the external ones), once every
        engine is up; the first engine's failure raises here, with its server's log tail."""
        import ray

        self.engine_urls += ray.get([engine.url.remote() for engine in self.engines])
        return self.engine_urls

    def spawn_engines(self, model_dir: str) -> None:
        """Start the engines' actors (each engine's start goes on in its own), without waiting for them."""
        e, r = self.cfg.engine, self.cfg.ray
        bundles = colocated_bundles(self.cfg)
        if bundles and self.group is None:
            self.group = placement_group(bundles, resources=_added(r.engine_resources, r.trainer_resources))
        if e.backend == "external":
            self.engine_urls = list(e.urls)
        for i in range(0 if e.backend == "external" else e.num_engines):
            start = engine_starter(self.cfg, model_dir, i, self.network)
            scheduling = on_bundle(self.group, i)
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

    async def where(self, out: Path | None = None) -> dict[str, Any]:
        """Where the driver, each engine (with its URL), each trainer rank, each rollout shard and each of
        the recipe's servers (with its name and URL) run: Ray node id and address, pid; the servers'
        ``listen`` address; written to ``out`` as JSON when given."""
        engines = await asyncio.gather(*[a.location.remote() for a in self.engines])
        servers = [a for a in self.services if a not in self.engines]
        placed = {
            "listen": self.network.host,
            "driver": location(),
            "engines": [{**at, "url": url} for at, url in zip(engines, self.engine_urls, strict=False)],
            "trainer_ranks": await self.trainer.locations() if self.trainer is not None else [],
            "rollout_shards": await self.rollout.locations() if self.rollout is not None else [],
            "services": list(await asyncio.gather(*[a.info.remote() for a in servers])),
        }
        if out is not None:
            out.write_text(json.dumps(placed, indent=2) + "\n")
        return placed

    async def check_reachable(self, placed: dict[str, Any]) -> None:
        """A ConfigError when a loopback URL is handed to a part of the run on another node than its
        server (:func:`loopback_across_nodes`): its calls would reach nothing, or another host's server."""
        if problem := loopback_across_nodes(placed):
            raise ConfigError(f"ray.listen: {problem}; set ray.listen: node (or auto)")

    async def stop(self, lost_node: bool = False) -> None:
        """Stop everything, each part even when another fails: the rollout, the trainer (it leaves the
        weight-sync group together with the engines, bounded), the clients, the engines and servers, Ray.
        ``lost_node``: a node of the run is gone, and what waits on its parts waits briefly."""
        import ray

        wait = 10.0 if lost_node else 60.0
        if self.rollout is not None:
            try:
                await asyncio.wait_for(self.rollout.stop(), wait)
            except Exception as err:  # keep shutting the rest down
                print(f"rollout stop failed: {err}", file=sys.stderr)
        if self.trainer is not None:
            try:
                await self.trainer.shutdown(**({"timeout": 15.0, "leave_timeout": 3.0} if lost_node else {}))
            except Exception as err:
                print(f"trainer shutdown failed: {err}", file=sys.stderr)
        for client in (self.control, self.monitor):
            if client is not None:
                await client.close()
        stop_all(self.services, timeout=wait)
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
        ray.shutdown()
