"""The files a user copies to launch a cluster, under test: ``scripts/cluster/ray_up.sh`` (its usage and
ports), ``scripts/cluster/slurm.sbatch`` and ``scripts/cluster/rayjob.yaml``.

The Slurm script runs as ``sbatch`` would run it, on the job's first node, with ``srun``, ``scontrol`` and
``hostname`` replaced by shims that run each "node"'s command in one of two network namespaces
(:mod:`agentrl.testing.netns`): it really starts a Ray cluster of two hosts with ``ray_up.sh``, and the
run it starts joins that cluster, with the job's token. The run asks for a resource no node has, so it
fails at start, naming the field, and the script stops both nodes on its way out. No Kubernetes cluster is
at hand: the RayJob manifest is checked for the RayJob shape and for ports and environment that agree
with ``ray_up.sh``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from agentrl.testing.netns import TwoHosts, need_netns

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "scripts" / "cluster"
RAY_UP = CLUSTER / "ray_up.sh"


def _ray_up(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RAY_UP), *args], capture_output=True, text=True, timeout=60)


def _ports() -> dict[str, int]:
    out = _ray_up("ports")
    assert out.returncode == 0, out.stderr
    return {k: int(v) for k, v in (line.split("=") for line in out.stdout.split())}


# ---- ray_up.sh --------------------------------------------------------------------------------------------


def test_ray_up_says_how_to_use_it() -> None:
    ports = _ports()
    assert ports["GCS_PORT"] == 6379 and ports["MIN_WORKER_PORT"] < ports["MAX_WORKER_PORT"]
    assert len(set(ports.values())) == len(ports)
    bad = _ray_up()
    assert bad.returncode == 2 and "ray_up.sh head" in bad.stderr and "--token-file" in bad.stderr
    bad = _ray_up("worker", "--num-cpus", "1")
    assert bad.returncode == 2 and "--address HEAD_IP:PORT is required" in bad.stderr
    bad = _ray_up("head", "--bogus")
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr


# ---- RayJob -----------------------------------------------------------------------------------------------


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_rayjob_manifest_is_a_rayjob_that_agrees_with_ray_up() -> None:
    job = yaml.safe_load((CLUSTER / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    spec = job["spec"]
    assert "python train_async.py --ray-address auto" in spec["entrypoint"]
    cluster = spec["rayClusterSpec"]
    head, workers = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert workers and all(w["groupName"] and w["replicas"] >= 1 for w in workers)

    ports = _ports()
    by_param = {
        "node-manager-port": "NODE_MANAGER_PORT",
        "object-manager-port": "OBJECT_MANAGER_PORT",
        "dashboard-agent-grpc-port": "DASHBOARD_AGENT_GRPC_PORT",
        "dashboard-agent-listen-port": "DASHBOARD_AGENT_LISTEN_PORT",
        "metrics-export-port": "METRICS_EXPORT_PORT",
        "runtime-env-agent-port": "RUNTIME_ENV_AGENT_PORT",
        "min-worker-port": "MIN_WORKER_PORT",
        "max-worker-port": "MAX_WORKER_PORT",
    }
    resources = {}
    for group in (head, *workers):
        params = group["rayStartParams"]
        assert {p: int(params[p]) for p in by_param} == {p: ports[n] for p, n in by_param.items()}
        resources.update(json.loads(json.loads(params["resources"])))  # KubeRay's quoted JSON string
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"] and container["resources"]["limits"]
        opened = {p["containerPort"] for p in container["ports"]}
        assert {ports[n] for n in by_param.values() if "WORKER_PORT" not in n} <= opened
        env = _env(container)
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_AUTH_TOKEN"]["secretKeyRef"]["key"]
    head_ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {ports["GCS_PORT"], ports["DASHBOARD_PORT"], ports["RAY_CLIENT_SERVER_PORT"]} <= head_ports
    assert _env(head["template"]["spec"]["containers"][0])["AGENTRL_RUN_SECRET"]["secretKeyRef"]["key"]
    (submitter,) = spec["submitterPodTemplate"]["spec"]["containers"]
    assert _env(submitter)["RAY_AUTH_MODE"] == "token" and _env(submitter)["RAY_AUTH_TOKEN"]

    # the resources the entrypoint asks for are declared by the pods; and ray_up.sh speaks of the same
    # environment
    for name in ("engine_node", "rollout_node", "trainer_node", "service_node"):
        assert f"{{{name}: 1}}" in spec["entrypoint"] and name in resources
    text = RAY_UP.read_text()
    assert "RAY_AUTH_MODE=token" in text and "RAY_AUTH_TOKEN" in text


# ---- Slurm ------------------------------------------------------------------------------------------------

SHIMS = {
    # scontrol show hostnames LIST: the job's node names
    "scontrol": """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || exit 1
printf "%s\\n" $SHIM_NODES
""",
    # srun ... -w NODE CMD...: CMD in NODE's namespace
    "srun": """#!/usr/bin/env bash
while (($#)); do
  case $1 in
    -w) node=$2; shift 2 ;;
    --nodelist=*) node=${1#*=}; shift ;;
    -*) shift ;;
    *) break ;;
  esac
done
echo "srun $node: $*" >> "$SHIM_LOG"
ns=$(tr ' ' '\\n' <<< "$SHIM_NAMESPACES" | sed -n "s/^$node=//p")
exec ip netns exec "$ns" "$@"
""",
    # hostname --ip-address: the address of the namespace it runs in
    "hostname": "#!/usr/bin/env bash\nip -o -4 addr show scope global | awk '{print $4}' | cut -d/ -f1\n",
}

CONFIG = """recipe: default
output_dir: {out}
model_path: {model}
data: {{path: {data}}}
env: {{name: math}}
rollout: {{group_size: 2, batch_size: 2, max_turns: 1, sampling: {{max_new_tokens: 8}}}}
trainer: {{device: cpu}}
eval: {{before: false, after: false}}
ray: {{engine_resources: {{gpu_box: 1}}}}
"""


def test_slurm_script_starts_the_nodes_and_runs_the_job_on_them(tmp_path: Path, tiny_model_dir: Path) -> None:
    need_netns()
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in SHIMS.items():
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"task_id": f"q{i}", "prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(4)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(CONFIG.format(out=tmp_path / "run", model=tiny_model_dir, data=data))

    with TwoHosts() as hosts:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")},
            "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
            "PYTHON": sys.executable,
            "SHIM_NODES": "node-a node-b",
            "SHIM_NAMESPACES": f"node-a={hosts.a.name} node-b={hosts.b.name}",
            "SHIM_LOG": str(tmp_path / "srun.log"),
            "SLURM_JOB_NODELIST": "node-[a-b]",
            "SLURM_SUBMIT_DIR": str(ROOT),
            "SLURM_CPUS_ON_NODE": "2",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        t0 = time.monotonic()
        proc = hosts.a.run(
            ["bash", str(CLUSTER / "slurm.sbatch"), "--config", str(cfg)],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        took = time.monotonic() - t0
        left = {host.name: host.pids() for host in hosts.hosts}
    out = proc.stdout + proc.stderr
    srun = (tmp_path / "srun.log").read_text()
    assert "slurm.sbatch: 2 Ray nodes up" in out, out[-5000:]
    assert f"srun node-a: {RAY_UP.relative_to(ROOT)} head --block --node-ip-address {hosts.a.address}" in srun
    assert f"srun node-b: {RAY_UP.relative_to(ROOT)} worker --block --address {hosts.a.address}:6379" in srun
    # the job joined the two-node cluster (with the job's token), checked it and failed at start
    assert proc.returncode != 0
    assert "ray.engine_resources: no node of the Ray cluster has the resource 'gpu_box'" in proc.stderr, out
    assert took < 240, took
    assert left == {hosts.a.name: [], hosts.b.name: []}, "the script left processes behind on the nodes"
