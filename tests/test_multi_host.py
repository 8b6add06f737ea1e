"""A Ray cluster of two hosts that share no loopback: two network namespaces joined by a veth pair
(:mod:`agentrl.testing.netns`), the head in one (resources ``trainer_node`` and ``service_node``) and a
worker in the other (``engine_node`` and ``rollout_node``), both started by ``scripts/cluster/ray_up.sh``
as a user starts them, Ray's token authentication on. The harness itself: two node addresses, each node's
tasks see their own, and a loopback listener of one host is out of the other's reach.

Namespaces need root; the tests fail without them under ``CI=true`` and skip with the reason elsewhere.
"""

from __future__ import annotations

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

import pytest

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


def _start_cluster() -> NamespaceCluster:
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
    except BaseException:
        _remove(cluster)
        raise
    return cluster


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
