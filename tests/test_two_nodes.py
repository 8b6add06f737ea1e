"""A Ray cluster of two nodes on one machine, started as a user starts one (``ray start --head`` and
``ray start --address``), each node declaring a custom resource: ``train_async.py`` joins it with
``--ray-address``, and ``ray.engine_resources`` / ``ray.trainer_resources`` put the engine on one node and
the trainer on the other, with weights broadcast between them (gloo). The run must finish, say where each
actor ran, and leave nothing running; a resource no node has fails at start, naming the field. The load-time
checks of those fields and the node check on ``ray.nodes()`` are tested without Ray.

The cluster is stopped by its own processes (each ``ray start --block``, then whatever carries this
cluster's mark), never by ``ray stop``, which stops every Ray instance of the user on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agentrl.cluster import free_port
from agentrl.config import ConfigError
from agentrl.metrics import read_metrics
from agentrl.placement import check_resources
from agentrl.testing.configs import TINY_SEARCH_R1

ROOT = Path(__file__).resolve().parent.parent
MARK = "AGENTRL_TEST_RAY_CLUSTER"  # in the env of every process of the cluster (inherited from ray start)

CONFIG = (
    TINY_SEARCH_R1
    + """output_dir: {out}
steps: 2
engine: {{max_batch_size: 8}}
weight_sync: distributed
ray: {{engine_resources: {{engine_node: 1}}, trainer_resources: {{trainer_node: 1}}}}
rollout: {{group_size: 2, batch_size: 2, max_staleness: 1, max_concurrency: 8, max_turns: 2,
          max_total_tokens: 400, sampling: {{temperature: 1.0, max_new_tokens: 16}},
          eval_sampling: {{temperature: 0.0, max_new_tokens: 16}}, verifier: exact_match,
          filter_zero_variance: false}}
trainer: {{device: cpu, lr: 1.0e-4, micro_batch_size: 4}}
eval: {{num_tasks: 4}}
"""
)

# ---- config checks (no Ray) ------------------------------------------------------------------------------


def _run_config(**ray: object):
    from agentrl.run_config import RunConfig

    return RunConfig.model_validate(
        {"model_path": "m", "data": {"path": "d"}, "env": {"name": "search"}, "trainer": {}, "ray": ray}
    )


@pytest.mark.parametrize(
    ("ray", "message"),
    [
        ({"engine_resources": {"GPU": 1}}, "GPU is not a custom resource"),
        ({"trainer_resources": {"trainer_node": 0}}, "trainer_node: 0 is no amount Ray can reserve"),
        ({"engine_resources": {"n": 0.00001}}, "n: 1e-05 is no amount"),
    ],
)
def test_resource_fields_are_checked_at_load(ray: dict, message: str) -> None:
    from agentrl.recipe import load_run_config

    overrides = [f"ray.{k}={json.dumps(v)}" for k, v in ray.items()]
    base = ["model_path=m", "data.path=d", "env.name=search", "recipe=default"]
    with pytest.raises(ConfigError, match=rf"ray\.\w+_resources: .*{message}"):
        load_run_config(None, base + overrides)


def test_engine_resources_need_engines_the_run_starts() -> None:
    from agentrl.run_config import RunConfig

    external = {
        "model_path": "m",
        "data": {"path": "d"},
        "env": {"name": "search"},
        "trainer": {},
        "engine": {"backend": "external", "urls": ["http://127.0.0.1:1"]},
    }
    RunConfig.model_validate({**external, "ray": {"trainer_resources": {"trainer_node": 1}}})
    with pytest.raises(ValueError, match=r"ray\.engine_resources: engine\.backend external starts no engine"):
        RunConfig.model_validate({**external, "ray": {"engine_resources": {"engine_node": 1}}})


def test_node_check_names_the_field() -> None:
    engine_node = {"Alive": True, "Resources": {"CPU": 8.0, "engine_node": 1.0}}
    trainer_nodes = [{"Alive": True, "Resources": {"CPU": 8.0, "trainer_node": 1.0}} for _ in range(2)]
    dead = {"Alive": False, "Resources": {"gpu_box": 4.0}}
    cfg = _run_config(engine_resources={"engine_node": 1}, trainer_resources={"trainer_node": 1})
    check_resources(cfg, [engine_node, *trainer_nodes, dead])  # what the run asks for is there

    cfg = _run_config(engine_resources={"gpu_box": 1})  # only on a dead node
    with pytest.raises(ConfigError, match=r"ray\.engine_resources: no node .* has the resource 'gpu_box'"):
        check_resources(cfg, [engine_node, dead])
    cfg = _run_config(trainer_resources={"trainer_node": 1}).model_copy(update={"trainer_world_size": 3})
    with pytest.raises(ConfigError, match=r"ray.trainer_resources: 3 actors .* 3 in all, .* have 2"):
        check_resources(cfg, [engine_node, *trainer_nodes])
    cfg = _run_config(trainer_resources={"trainer_node": 2})  # 2 in all, but 1 on each node
    with pytest.raises(ConfigError, match=r"ray.trainer_resources: no node .* holds \{'trainer_node': 2.0\}"):
        check_resources(cfg, trainer_nodes)


def test_colocated_bundles_hold_the_custom_resources() -> None:
    """Colocated, engine i and trainer rank i sit on GPU i's bundle, which holds their custom resources
    too (an actor on a bundle gets only what the bundle holds)."""
    import ray

    from agentrl.actor_group import on_bundle
    from agentrl.placement import placement_group

    ray.init(num_cpus=2, num_gpus=2, resources={"gpu_box": 2}, include_dashboard=False, log_to_driver=False)
    try:
        group = placement_group(2, resources={"gpu_box": 1})

        @ray.remote
        def gpu() -> list[int]:
            return [int(g) for g in ray.get_gpu_ids()]

        engine = {"num_gpus": 0.5, "num_cpus": 0, "resources": {"gpu_box": 0.5}}
        rank = {"num_gpus": 0.5, "num_cpus": 1, "resources": {"gpu_box": 0.5}}
        placed = [
            gpu.options(**ask, scheduling_strategy=on_bundle(group, i)).remote()
            for i in range(2)
            for ask in (engine, rank)
        ]
        engine0, rank0, engine1, rank1 = ray.get(placed, timeout=60)
        assert engine0 == rank0 != engine1 == rank1
        ray.util.remove_placement_group(group)
    finally:
        ray.shutdown()


# ---- the cluster ------------------------------------------------------------------------------------------


@dataclass
class Cluster:
    address: str
    env: dict[str, str]
    temp_dir: Path
    nodes: list[subprocess.Popen] = field(default_factory=list)
    node_ids: dict[str, str] = field(default_factory=dict)  # custom resource -> the id of the node holding it

    def processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process carrying this cluster's mark."""
        mark = f"{MARK}={self.temp_dir}".encode()
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    out.append((int(entry.name), args.strip()))
            except OSError:  # gone, or not ours to read
                continue
        return out

    def stop(self, timeout: float = 60.0) -> list[str]:
        """Stop the nodes (SIGTERM to each ``ray start --block``: it drains and stops its node's processes),
        then SIGKILL whatever still carries the mark; returns what had to be killed."""
        for node in reversed(self.nodes):  # the worker node first, the head last
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
            try:
                node.wait(timeout)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait(10)
        deadline = time.monotonic() + 20
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid, _ in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return [args for _, args in left]


def _ray_start(cluster: Cluster, head: bool, num_cpus: int, resources: dict[str, float]) -> subprocess.Popen:
    # every port of its own (two nodes on one machine, and other Ray instances beside them)
    ports = [
        f"--{name}={free_port()}"
        for name in (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "metrics-export-port",
            "runtime-env-agent-port",
        )
    ]
    where = (
        [
            f"--port={cluster.address.rsplit(':', 1)[1]}",
            f"--temp-dir={cluster.temp_dir}",
            "--include-dashboard=false",
            f"--dashboard-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        ]
        if head
        else [f"--address={cluster.address}"]
    )
    cmd = [
        "ray",
        "start",
        *(["--head"] if head else []),
        "--block",
        *where,
        *ports,
        f"--num-cpus={num_cpus}",
        "--num-gpus=0",
        "--object-store-memory=100000000",
        f"--resources={json.dumps(resources)}",
        "--disable-usage-stats",
    ]
    with open(
        cluster.temp_dir / ("head.log" if head else "worker.log"), "w"
    ) as log:  # the node keeps its copy
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cluster.env)


def _wait_for_nodes(cluster: Cluster, count: int, timeout: float = 120.0) -> list[dict]:
    """The alive nodes (``ray.nodes()``, asked by a driver of its own) once ``count`` are up."""
    code = (
        "import json, sys, time, ray\n"
        "ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)\n"
        "deadline = time.monotonic() + float(sys.argv[3])\n"
        "while len(alive := [n for n in ray.nodes() if n['Alive']]) < int(sys.argv[2]):\n"
        "    assert time.monotonic() < deadline, alive\n"
        "    time.sleep(0.5)\n"
        "print(json.dumps(alive))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, cluster.address, str(count), str(timeout)],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=timeout + 60,
    )
    logs = "".join(p.read_text()[-2000:] for p in cluster.temp_dir.glob("*.log"))
    assert proc.returncode == 0, f"the cluster did not come up:\n{proc.stderr[-3000:]}\n{logs}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _start_two_nodes() -> Cluster:
    """Head node: 2 CPUs and ``trainer_node``; second node: 1 CPU and ``engine_node``. Token authentication
    on, with a token of this cluster's own (every process of it, and the job, get it)."""
    temp_dir = Path(tempfile.mkdtemp(prefix="agentrl-2n-", dir=os.environ.get("RAY_TMPDIR", "/tmp")))
    env = {
        **os.environ,
        MARK: str(temp_dir),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    cluster = Cluster(f"127.0.0.1:{free_port()}", env, temp_dir)
    try:
        cluster.nodes.append(_ray_start(cluster, True, 2, {"trainer_node": 1}))
        cluster.nodes.append(_ray_start(cluster, False, 1, {"engine_node": 1}))
        for node in _wait_for_nodes(cluster, 2):
            for name in ("engine_node", "trainer_node"):
                if name in node["Resources"]:
                    cluster.node_ids[name] = node["NodeID"]
    except BaseException:
        cluster.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return cluster


@pytest.fixture
def two_nodes() -> Iterator[Cluster]:
    """A two-node cluster of this machine (:func:`_start_two_nodes`). Its daemons bind ports found free a
    moment earlier, and a node that finds one taken meanwhile fails to start (Ray names the port only
    sometimes), so a cluster that does not come up is stopped and started again on other ports; the third
    failure fails the test. The cluster is Ray's alone: no agentrl code runs before the test body."""
    for attempt in range(3):
        try:
            cluster = _start_two_nodes()
            break
        except (AssertionError, subprocess.TimeoutExpired):
            if attempt == 2:
                raise
    try:
        yield cluster
    finally:
        cluster.stop()  # the test asserts a clean stop itself; this makes sure of it after a failure
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)


def _left_by_the_job(cluster: Cluster, timeout: float = 60.0) -> list[str]:
    """The job's processes (engine, retrieval server, its actors' workers) still alive ``timeout`` s after
    it exited; the cluster's own daemons and idle workers are not the job's."""
    job = (
        "agentrl.embedded.server",
        "retrieval_server",
        "ray::ServiceWorker",
        "ray::TrainerWorker",
        "ray::RolloutWorker",
        "train_async.py",
    )
    deadline = time.monotonic() + timeout
    while True:
        left = [args for _, args in cluster.processes() if any(p in args for p in job)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _train_async(cluster: Cluster, cfg: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train_async.py", "--config", str(cfg), "--ray-address", cluster.address],
        cwd=ROOT,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_engine_on_one_node_trainer_on_the_other(two_nodes: Cluster, tmp_path: Path) -> None:
    cluster = two_nodes
    assert set(cluster.node_ids) == {"engine_node", "trainer_node"}
    engine_node, trainer_node = cluster.node_ids["engine_node"], cluster.node_ids["trainer_node"]
    assert engine_node != trainer_node
    out = tmp_path / "run"
    cfg = tmp_path / "two_nodes.yaml"
    cfg.write_text(CONFIG.format(out=out, cache=tmp_path / "cache"))

    proc = _train_async(cluster, cfg, timeout=400)
    assert proc.returncode == 0, f"train_async failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    train = [r for r in read_metrics(out / "metrics.jsonl") if "policy_version" in r]
    assert [r["policy_version"] for r in train] == [1, 2]  # both weight syncs reached the engine
    placed = json.loads((out / "placement.json").read_text())
    assert [e["node_id"] for e in placed["engines"]] == [engine_node]
    assert [r["node_id"] for r in placed["trainer_ranks"]] == [trainer_node]
    assert f"node {engine_node[:8]} " in proc.stdout and f"node {trainer_node[:8]} " in proc.stdout
    assert not _left_by_the_job(cluster), "the run left processes behind on the cluster"

    # a resource no node declares fails at start, naming the field (Ray would wait for it forever)
    t0 = time.monotonic()
    cfg.write_text(
        cfg.read_text().replace("engine_resources: {engine_node: 1}", "engine_resources: {gpu_box: 1}")
    )
    proc = _train_async(cluster, cfg, timeout=300)
    assert proc.returncode != 0
    assert "ray.engine_resources: no node of the Ray cluster has the resource 'gpu_box'" in proc.stderr
    assert time.monotonic() - t0 < 120
    assert not _left_by_the_job(cluster), "the failed start left processes behind on the cluster"

    assert cluster.processes(), "the cluster's processes are not found by their mark"
    assert cluster.stop() == [], "stopping the nodes left processes behind"
    assert cluster.processes() == []
