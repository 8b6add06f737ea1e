"""A Ray cluster of two hosts that share no loopback: two network namespaces joined by a veth pair
(:mod:`agentrl.testing.netns`), the head in one (resources ``trainer_node`` and ``service_node``) and a
worker in the other (``engine_node`` and ``rollout_node``), both started by ``scripts/cluster/ray_up.sh``
as a user starts them, Ray's token authentication on.

First the harness itself: two node addresses, each node's tasks see their own, and a loopback listener
of one host is out of the other's reach. Then a tiny Search-R1 run with ``--ray-address`` of the head:
the engine and the rollout on the worker, the trainer and the retrieval server on the head, weights
broadcast over gloo. It must finish with every URL it hands across hosts off loopback, leave nothing
running, and learn as the same config does on one host: deterministic, both runs log the same figures
(the engine's prefix-cache counts aside) and end with the same weights, bit for bit. Then the worker's
host is lost mid-run: the run stops within 60 s naming the node and what ran there, and ``--resume`` on a
fresh worker trains every step once, no task lost or trained twice. Last, the nodes stop and leave
nothing behind.

Namespaces need root; the tests fail without them under ``CI=true`` and skip with the reason elsewhere.
"""

from __future__ import annotations

import contextlib
import gzip
import ipaddress
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
from typing import Any
from urllib.parse import urlsplit

import pytest

from agentrl.metrics import read_metrics, without_timings
from agentrl.testing.configs import TINY_SEARCH_R1
from agentrl.testing.netns import Host, TwoHosts, need_netns

ROOT = Path(__file__).resolve().parent.parent
RAY_UP = ROOT / "scripts" / "cluster" / "ray_up.sh"
HEAD_RESOURCES = {"trainer_node": 1, "service_node": 1}
WORKER_RESOURCES = {"engine_node": 1, "rollout_node": 1}
# the job's processes (engine, retrieval server, its actors' workers); the cluster's daemons are not the job's
JOB = (
    "agentrl.embedded.server",
    "retrieval_server",
    "ray::ServiceWorker",
    "ray::TrainerWorker",
    "ray::RolloutWorker",
    "train_async.py",
)


def ray_up_ports() -> dict[str, int]:
    """The fixed ports of ``ray_up.sh ports``."""
    out = subprocess.run([str(RAY_UP), "ports"], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split("=") for line in out.split())}


@dataclass
class NamespaceCluster:
    """The head node in ``hosts.a``, a worker in ``hosts.b``, each a ``ray_up.sh ... --block`` process."""

    hosts: TwoHosts
    env: dict[str, str]
    temp_dir: Path
    nodes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.hosts.a.address}:{ray_up_ports()['GCS_PORT']}"

    def start_node(self, role: str) -> None:
        host = self.hosts.a if role == "head" else self.hosts.b
        resources = HEAD_RESOURCES if role == "head" else WORKER_RESOURCES
        where = [] if role == "head" else ["--address", self.address]
        log = (self.temp_dir / f"{role}.log").open("a")
        self.nodes[role] = host.popen(
            [
                str(RAY_UP),
                role,
                *where,
                "--block",
                "--node-ip-address",
                host.address,
                "--temp-dir",
                str(self.temp_dir / role),
                "--num-cpus",
                "2",
                "--num-gpus",
                "0",
                "--resources",
                json.dumps(resources),
                "--",
                "--object-store-memory=100000000",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=ROOT,
        )

    def stop_node(self, role: str, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
        """Signal the node's ``ray start --block`` (SIGTERM: it stops its node's daemons and workers) and
        wait for it; SIGKILL to its process group when it does not exit in ``timeout`` s."""
        node = self.nodes[role]
        if node.poll() is None:
            node.send_signal(sig)
        try:
            node.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(10)

    def logs(self) -> str:
        return "".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.temp_dir.glob("*.log")))

    def run(self, host: Host, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        return host.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)

    def alive_nodes(self, count: int, timeout: float = 120.0) -> list[dict[str, Any]]:
        """``ray.nodes()`` (asked by a driver on the head's host) once ``count`` nodes are alive."""
        code = (
            "import json, sys, time, ray\n"
            "ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)\n"
            "deadline = time.monotonic() + float(sys.argv[3])\n"
            "while len(alive := [n for n in ray.nodes() if n['Alive']]) != int(sys.argv[2]):\n"
            "    assert time.monotonic() < deadline, alive\n"
            "    time.sleep(0.5)\n"
            "print(json.dumps(alive))\n"
        )
        cmd = [sys.executable, "-c", code, self.address, str(count), str(timeout)]
        proc = self.run(self.hosts.a, cmd, timeout + 60)
        assert proc.returncode == 0, f"the cluster did not come up:\n{proc.stderr[-3000:]}\n{self.logs()}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def job_processes(self) -> list[str]:
        """Command lines of the job's processes still running on either host."""
        left = []
        for host in self.hosts.hosts:
            for pid in host.pids():
                args = _cmdline(pid)
                if any(p in args for p in JOB):
                    left.append(f"{host.name}: {pid} {args}")
        return left

    def left_by_the_job(self, timeout: float = 60.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while (left := self.job_processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def stop(self) -> list[int]:
        """Stop the worker node, then the head, then whatever still runs in either namespace; returns the
        pids that had to be killed."""
        for role in ("worker", "head"):
            if role in self.nodes:
                self.stop_node(role)
        return [pid for host in (self.hosts.b, self.hosts.a) for pid in host.stop_processes()]


# Ray gives a starting node's raylet 30 s to register; a loaded 2-core machine can miss that, and the
# head's `ray start` then exits. A head that exited while starting is started once more; a cluster that
# does not form for any other reason fails at once.
HEAD_STARTS = 2


def _start_cluster(attempt: int = 1) -> NamespaceCluster:
    hosts = TwoHosts()
    temp_dir = Path(tempfile.mkdtemp(prefix="agentrl-mh-", dir=os.environ.get("RAY_TMPDIR", "/tmp")))
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    cluster = NamespaceCluster(hosts, env, temp_dir)
    try:
        cluster.start_node("head")
        cluster.start_node("worker")  # it waits for the head's GCS to answer
        cluster.alive_nodes(2)
        return cluster
    except AssertionError:
        head_exited = cluster.nodes["head"].poll() is not None
        _remove(cluster)
        if not head_exited or attempt == HEAD_STARTS:
            raise
    except BaseException:
        _remove(cluster)
        raise
    print(f"the head node exited while starting (attempt {attempt}); starting the cluster again")
    return _start_cluster(attempt + 1)


def _remove(cluster: NamespaceCluster) -> None:
    cluster.stop()
    cluster.hosts.close()
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[NamespaceCluster]:
    """The two-host cluster, shared by the module's tests (each leaves it as it found it)."""
    need_netns()
    cluster = _start_cluster()
    try:
        yield cluster
    finally:
        _remove(cluster)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


# ---- the harness ------------------------------------------------------------------------------------------

PROBE = r"""
import json, socket, sys, ray

ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)


@ray.remote(num_cpus=0, resources={"trainer_node": 0.01})
class Listener:
    '''A socket on the head's loopback.'''

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()

    def port(self):
        return self.sock.getsockname()[1]


@ray.remote(num_cpus=0)
def probe(port):
    s = socket.socket()
    s.settimeout(5)
    return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
            "loopback_port": s.connect_ex(("127.0.0.1", port))}


listener = Listener.remote()  # kept: the actor, and its socket, live while the handle does
port = ray.get(listener.port.remote())
seen = {name: probe.options(resources={name: 0.01}).remote(port) for name in ("trainer_node", "engine_node")}
print(json.dumps({name: ray.get(ref) for name, ref in seen.items()}))
"""


def test_two_hosts_share_no_loopback(cluster: NamespaceCluster) -> None:
    nodes = cluster.alive_nodes(2)
    ips = {n["NodeManagerAddress"] for n in nodes}
    assert ips == {cluster.hosts.a.address, cluster.hosts.b.address}
    by_resource = {
        name: n for n in nodes for name in n["Resources"] if name in HEAD_RESOURCES | WORKER_RESOURCES
    }
    assert by_resource["trainer_node"]["NodeManagerAddress"] == cluster.hosts.a.address
    assert by_resource["engine_node"]["NodeManagerAddress"] == cluster.hosts.b.address

    proc = cluster.run(cluster.hosts.a, [sys.executable, "-c", PROBE, cluster.address], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["trainer_node"]["node_ip"] == cluster.hosts.a.address
    assert seen["engine_node"]["node_ip"] == cluster.hosts.b.address
    assert seen["trainer_node"]["loopback_port"] == 0  # the head's loopback listener, from the head
    assert seen["engine_node"]["loopback_port"] != 0  # refused: the worker's loopback is its own

    # token authentication on: every daemon of both nodes runs with it
    for host in cluster.hosts.hosts:
        daemons = [
            pid for pid in host.pids() if _cmdline(pid).split(" ")[0].endswith(("gcs_server", "raylet"))
        ]
        assert daemons and all(b"RAY_AUTH_MODE=token" in _environ(pid) for pid in daemons), host.name


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:  # gone
        return ""


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def test_without_namespaces_ci_fails_and_elsewhere_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("AGENTRL_REQUIRE_NETNS", raising=False)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"need network namespaces, but .* need root"):
        need_netns()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=r"need root .*CI fails here instead"):
        need_netns()


# ---- a run across the two hosts ---------------------------------------------------------------------------

CONFIG = (
    TINY_SEARCH_R1
    + """output_dir: {out}
steps: 2
deterministic: true
engine: {{max_batch_size: 8}}
weight_sync: distributed
rollout: {{group_size: 2, batch_size: 2, max_staleness: 1, max_concurrency: 8, max_turns: 2,
          max_total_tokens: 400, sampling: {{temperature: 1.0, max_new_tokens: 16}},
          eval_sampling: {{temperature: 0.0, max_new_tokens: 16}}, verifier: exact_match,
          filter_zero_variance: false}}
trainer: {{device: cpu, lr: 1.0e-4, micro_batch_size: 4}}
eval: {{num_tasks: 4}}
"""
)
# where each part goes: the engine and the rollout on the worker, the trainer and the retrieval server on
# the head
ROLES = {
    "engine": "engine_node",
    "rollout": "rollout_node",
    "trainer": "trainer_node",
    "service": "service_node",
}
ACROSS = [f"ray.{role}_resources={{{name}: 1}}" for role, name in ROLES.items()]


def _train_async(
    cmd_host: Host, env: dict[str, str], cfg: Path, *args: str, timeout: float
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train_async.py", "--config", str(cfg), *args]
    return cmd_host.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _urls(record: Any) -> list[str]:
    """Every ``url`` value anywhere in a placement record."""
    if isinstance(record, dict):
        return [v for k, v in record.items() if k == "url" and isinstance(v, str)] + [
            u for v in record.values() for u in _urls(v)
        ]
    if isinstance(record, list):
        return [u for v in record for u in _urls(v)]
    return []


def _node_ips(record: Any) -> set[str]:
    if isinstance(record, dict):
        own = {record["node_ip"]} if isinstance(record.get("node_ip"), str) else set()
        return own.union(*(_node_ips(v) for v in record.values()))
    if isinstance(record, list):
        return set().union(*(_node_ips(v) for v in record))
    return set()


def _trained(out: Path) -> list[dict[str, Any]]:
    return [without_timings(r) for r in read_metrics(out / "metrics.jsonl")]


# the engine's prefix-cache counts depend on which requests meet in the engine at the same moment (timing),
# not on what it generates
CACHE_COUNTS = ("rollout/cached_input_tokens", "rollout/prefix_cache_hit_rate")


def _learned(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in CACHE_COUNTS}


def _final_weights(out: Path) -> dict[str, bytes]:
    import torch

    step = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    model = torch.load(step / "rank_00000.pt", map_location="cpu", weights_only=False)["model"]
    return {k: v.numpy().tobytes() for k, v in model.items() if isinstance(v, torch.Tensor)}


@pytest.mark.slow
def test_search_r1_across_two_hosts_learns_as_on_one(
    cluster: NamespaceCluster, tmp_path: Path, search_r1_cache: Path
) -> None:
    a, b = cluster.hosts.a, cluster.hosts.b
    two, one = tmp_path / "two", tmp_path / "one"
    (tmp_path / "two.yaml").write_text(CONFIG.format(out=two, cache=search_r1_cache))
    (tmp_path / "one.yaml").write_text(CONFIG.format(out=one, cache=search_r1_cache))
    # the same config on one host (a local Ray, everything on loopback), at the same time: deterministic
    # runs agree whatever their timing, and its processes are outside the cluster's namespaces. It runs
    # first, alone, when the bootstrap cache is still to be built (two runs would write it together).
    built = any(search_r1_cache.glob("sft-*/DONE"))
    with (tmp_path / "one.log").open("w") as log:
        alone = subprocess.Popen(
            [sys.executable, "train_async.py", "--config", str(tmp_path / "one.yaml"), "ray.num_cpus=4"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        if not built:
            alone.wait(timeout=500)
        t0 = time.monotonic()
        proc = _train_async(
            a, cluster.env, tmp_path / "two.yaml", "--ray-address", cluster.address, *ACROSS, timeout=500
        )
        took = time.monotonic() - t0
        alone.wait(timeout=500)
    finally:
        if alone.poll() is None:
            alone.kill()
            alone.wait(10)
    assert proc.returncode == 0, f"the two-host run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = _trained(two)
    assert [r["policy_version"] for r in rows if "policy_version" in r] == [1, 2]

    placed = json.loads((two / "placement.json").read_text())
    assert _node_ips(placed) == {a.address, b.address}, placed
    assert {e["node_ip"] for e in placed["engines"]} == {b.address}
    assert {r["node_ip"] for r in placed["trainer_ranks"]} == {a.address}
    assert {r["node_ip"] for r in placed["rollout_shards"]} == {b.address}
    assert {s["node_ip"] for s in placed["services"]} == {a.address}
    assert not _is_loopback(placed["listen"])
    urls = _urls(placed)
    assert urls and not [u for u in urls if _is_loopback(urlsplit(u).hostname or "")], placed
    nodes = {at["node_id"] for at in [*placed["engines"], *placed["trainer_ranks"]]}
    assert all(f"node {node[:8]} " in proc.stdout for node in nodes), proc.stdout[-3000:]  # said at start
    assert not cluster.left_by_the_job(), "the run left processes behind on the cluster"

    # the one-host run: the same figures, the same weights
    assert alone.returncode == 0, f"the one-host run failed:\n{(tmp_path / 'one.log').read_text()[-8000:]}"
    assert [_learned(r) for r in _trained(one)] == [_learned(r) for r in rows]
    assert _final_weights(one) == _final_weights(two)
    print(f"two-host run: {took:.0f} s")


# ---- a host lost mid-run ----------------------------------------------------------------------------------

LOST_CONFIG = (
    TINY_SEARCH_R1
    + """output_dir: {out}
steps: {steps}
engine: {{max_batch_size: 8}}
weight_sync: disk
checkpoint: {{interval: 1}}
rollout: {{group_size: 2, batch_size: 2, max_staleness: 1, max_concurrency: 8, max_turns: 2,
          max_total_tokens: 400, sampling: {{temperature: 1.0, max_new_tokens: 16}},
          verifier: exact_match, filter_zero_variance: false, dump: all}}
trainer: {{device: cpu, lr: 1.0e-4, micro_batch_size: 4}}
eval: {{before: false, after: false}}
"""
)
B = 2  # groups per batch
STEPS = 6  # enough that the host is lost with steps still to train (after the first checkpoint; the
# trainer runs at most a batch or two ahead of the rollout)


def _dumped(out: Path) -> dict[int, list[dict[str, Any]]]:
    """The training batch of every step, as the episode dumps hold it (a resumed run rewrites its steps)."""
    batches = {}
    for f in sorted((out / "trajectories").glob("step_*.jsonl.gz")):
        with gzip.open(f, "rt") as fh:
            batches[int(f.name[5:11])] = [r for line in fh if (r := json.loads(line))["kind"] == "train"]
    return batches


@pytest.mark.slow
def test_a_host_lost_mid_run_stops_it_and_resume_loses_nothing(
    cluster: NamespaceCluster, tmp_path: Path, search_r1_cache: Path
) -> None:
    a, b = cluster.hosts.a, cluster.hosts.b
    out, cfg = tmp_path / "run", tmp_path / "run.yaml"
    cfg.write_text(LOST_CONFIG.format(out=out, cache=search_r1_cache, steps=STEPS))
    cmd = [sys.executable, "-u", "train_async.py", "--config", str(cfg), "--ray-address", cluster.address]
    log = tmp_path / "run.log"
    engine_dirs = {p.name for p in Path(tempfile.gettempdir()).glob("agentrl-engine-*")}
    with log.open("w") as sink:
        job = a.popen([*cmd, *ACROSS], cwd=ROOT, env=cluster.env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        # the worker's host goes away once a step is trained and checkpointed: its Ray node and everything
        # on it killed at once (the engine, the rollout shard)
        deadline = time.monotonic() + 400
        while not (out / "checkpoints" / "latest").is_file():
            assert job.poll() is None, (
                f"the run ended before its first checkpoint:\n{log.read_text()[-4000:]}"
            )
            assert time.monotonic() < deadline, f"no checkpoint in 400 s:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        os.killpg(cluster.nodes["worker"].pid, signal.SIGKILL)
        for pid in b.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        lost_at = time.monotonic()
        job.wait(timeout=120)
        took = time.monotonic() - lost_at
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
    text = log.read_text()
    assert job.returncode != 0, text[-4000:]
    assert took < 60, f"the run took {took:.0f} s to stop after its host was lost"
    said = [line for line in text.splitlines() if f"({b.address})" in line and "lost node" in line]
    assert len(said) == 1 and "engine 0" in said[0] and "rollout shard 0" in said[0], text[-4000:]
    assert not cluster.left_by_the_job(), "the stopped run left processes behind"
    trained_before = sorted(_dumped(out))
    assert trained_before and max(trained_before) < STEPS, trained_before  # the resume has work to do

    # a fresh worker, and the run resumed: every step trained once, no task lost or trained twice
    cluster.start_node("worker")
    cluster.alive_nodes(2)
    proc = _train_async(
        a, cluster.env, cfg, "--ray-address", cluster.address, *ACROSS, "--resume", timeout=500
    )
    assert proc.returncode == 0, f"the resumed run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "resumed at step" in proc.stdout
    dumps = _dumped(out)
    rows = {int(r["step"]): r for r in read_metrics(out / "metrics.jsonl") if "policy_version" in r}
    steps = list(range(1, STEPS + 1))
    assert sorted(dumps) == sorted(rows) == steps, (trained_before, sorted(rows))
    assert [rows[s]["policy_version"] for s in steps] == steps
    assert [rows[s]["rollout/trained_groups"] for s in steps] == [B * s for s in steps]
    firsts = [r["task_id"] for s in dumps for r in dumps[s] if r["sample_index"] == 0]
    assert len(firsts) == STEPS * B and len(set(firsts)) == len(firsts), firsts
    assert all(r["trained"] and r["status"] != "failed" for s in dumps for r in dumps[s])
    assert not cluster.left_by_the_job(), "the resumed run left processes behind"
    # the lost host's engine never removed its scratch dir (the port file): that one, and no other
    scratch = [p for p in Path(tempfile.gettempdir()).glob("agentrl-engine-*") if p.name not in engine_dirs]
    assert len(scratch) <= 1, scratch
    for p in scratch:
        shutil.rmtree(p)
    print(f"lost host: the run stopped {took:.1f} s after it; steps before: {trained_before}")


def test_the_cluster_stops_clean(cluster: NamespaceCluster) -> None:
    """Last in the module: the nodes stop with their ``ray start --block`` and leave nothing behind."""
    assert cluster.stop() == [], "stopping the nodes left processes behind"
    assert [host.pids() for host in cluster.hosts.hosts] == [[], []]
