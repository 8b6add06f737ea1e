"""Sandbox latency: p50/p99 of ``print(1)`` through the warm Docker pool (1 and 16 concurrent) against a cold
``docker run`` of the same image and limits, and the same for ProcessSandbox against a bare unsandboxed
``python3 -c 'print(1)'``, all measured in this run. Prints one JSON line.

    python bench/sandbox_latency.py [--n 60] [--concurrency 16] [--cold-n 10] [--skip-docker]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time

import numpy as np

from agentrl.sandboxes import DockerSandbox, ProcessSandbox, docker_available

CODE = "print(1)"


def pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1000.0
    return {
        "p50_ms": round(float(np.percentile(a, 50)), 2),
        "p99_ms": round(float(np.percentile(a, 99)), 2),
        "n": len(xs),
    }


async def timed_run(sb) -> float:
    t0 = time.perf_counter()
    r = await sb.run(CODE)
    dt = time.perf_counter() - t0
    if r.stdout != "1\n":
        raise RuntimeError(f"unexpected result {r}")
    return dt


async def measure(sb, n: int, concurrency: int) -> dict[str, float]:
    for _ in range(3):  # warm-up
        await timed_run(sb)
    lat: list[float] = []
    t0 = time.perf_counter()
    if concurrency == 1:
        for _ in range(n):
            lat.append(await timed_run(sb))
    else:
        rounds = max(1, n // concurrency)
        for _ in range(rounds):
            lat += await asyncio.gather(*(timed_run(sb) for _ in range(concurrency)))
    out = pct(lat)
    out["runs_per_s"] = round(len(lat) / (time.perf_counter() - t0), 1)
    return out


def cold_docker(image: str, n: int) -> dict[str, float]:
    """``docker run --rm`` with the pool's isolation flags: create + start + wait + logs + remove."""
    import docker

    client = docker.from_env()
    lat = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            out = client.containers.run(
                image,
                ["python3", "-c", CODE],
                remove=True,
                network_mode="none",
                mem_limit="512m",
                memswap_limit="512m",
                pids_limit=64,
                read_only=True,
                tmpfs={"/work": "size=64m,mode=1777"},
                user="65534:65534",
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                labels={"agentrl": "1", "agentrl.owner": "bench"},
            )
            lat.append(time.perf_counter() - t0)
            assert out == b"1\n", out
    finally:
        client.close()
    return pct(lat)


def bare_process(python: str, n: int) -> dict[str, float]:
    """The same interpreter with no sandbox at all: the floor any process-based sandbox sits on."""
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([python, "-c", CODE], check=True, capture_output=True)
        lat.append(time.perf_counter() - t0)
    return pct(lat)


async def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=60, help="samples per configuration")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cold-n", type=int, default=10, help="cold docker run samples")
    p.add_argument("--image", default="agentrl-sandbox:latest")
    p.add_argument("--skip-docker", action="store_true")
    args = p.parse_args()
    c = args.concurrency
    res: dict = {
        "bench": "sandbox_latency",
        "code": CODE,
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }

    async with ProcessSandbox(max_concurrency=c) as sb:
        res["process"] = {
            "isolation": sb.isolation,
            "c1": await measure(sb, args.n, 1),
            f"c{c}": await measure(sb, args.n, c),
        }
        python = sb._python  # the same interpreter, unsandboxed, is the baseline
    res["process"]["bare_python_baseline"] = bare_process(python, min(args.n, 30))
    res["process"]["overhead_vs_bare_p50"] = round(
        res["process"]["c1"]["p50_ms"] / res["process"]["bare_python_baseline"]["p50_ms"], 2
    )

    if not args.skip_docker and docker_available():
        async with DockerSandbox(image=args.image, pool_size=c, max_containers=c) as sb:
            await sb.start()
            res["docker"] = {"c1": await measure(sb, args.n, 1), f"c{c}": await measure(sb, args.n, c)}
        res["docker"]["cold_docker_run"] = cold_docker(args.image, args.cold_n)
        cold = res["docker"]["cold_docker_run"]["p50_ms"]
        res["docker"]["speedup_warm_vs_cold_p50"] = round(cold / res["docker"]["c1"]["p50_ms"], 2)
        res["docker"][f"speedup_warm_c{c}_vs_cold_p50"] = round(cold / res["docker"][f"c{c}"]["p50_ms"], 2)
    else:
        res["docker"] = None
    return res


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
