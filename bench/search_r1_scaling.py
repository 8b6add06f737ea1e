"""Search-R1 on several GPUs against one, in one call: trajectories a second, held-out exact match, and where
each run's step goes.

    python bench/search_r1_scaling.py                     # one GPU, then colocated DP over every GPU
    python bench/search_r1_scaling.py --disaggregated     # also half the GPUs engines, half trainer ranks
    python bench/search_r1_scaling.py --dry-run           # the runs' commands; runs nothing

Each run is ``python train_async.py --config examples/search_r1/config_gpu.yaml`` (SmolLM2-135M, the
embedded engine) with the same warm start (the bootstrap cache, built by the first run and read by the
others), world, seeds, step count and engine KV pool (``--pool``, of a GPU's free memory), and the one-GPU
run's batch and requests in flight for each GPU that generates (the config's ``rollout.batch_size`` and
``rollout.max_concurrency``, after the overrides given for every run):

- **one GPU**: the config on the first GPU alone (``CUDA_VISIBLE_DEVICES``), the baseline;
- **colocated, DP N**: engine i and trainer rank i on GPU i, a rollout shard per engine, N times the
  batch and the requests in flight;
- **disaggregated** (``--disaggregated``): N/2 engines on GPUs of their own, N/2 trainer ranks (data
  parallel) on the others, the weights broadcast over NCCL to every engine each step, one step off-policy;
  N/2 times the batch.

It prints one JSON line: for each run its trajectories a second over steps 2 to the last (the first holds
the warm-ups), the mean step and its parts (waiting for the batch, training, the weight sync and the other
hand-overs: every ``time/*`` figure), the load of the rollout's event loop and of the retrieval server,
held-out exact match at each evaluation and at the end (± its standard error), its wall time, and the
ratio of its trajectories a second to the one-GPU run's. The runs' own outputs stay under ``--out``.
Results: docs/results/multi-gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentrl.config import ConfigError  # noqa: E402
from agentrl.metrics import read_metrics  # noqa: E402
from agentrl.recipe import load_run_config  # noqa: E402

CONFIG = ROOT / "examples" / "search_r1" / "config_gpu.yaml"
EXACT_MATCH = "eval/exact_match"
LOADS = ("rollout/loop_busy_frac", "retrieval/busy_frac", "retrieval/request_ms_mean")


@dataclass(frozen=True)
class Run:
    """One ``train_async.py`` run of the comparison."""

    name: str
    gpus: list[str]  # the CUDA_VISIBLE_DEVICES it gets
    overrides: list[str]
    trajectories: int  # a step's: groups x group size


def plan(
    gpus: list[str], batch: int, group: int, concurrency: int, pool: float, disaggregated: bool
) -> list[Run]:
    """The runs, the one-GPU baseline first: each GPU that generates gets the baseline's ``batch`` groups
    and ``concurrency`` requests in flight."""
    n = len(gpus)
    pool_arg = [f"engine.mem_fraction={pool}"]
    runs = [Run("one_gpu", gpus[:1], pool_arg, batch * group)]
    if n >= 2:
        dp = [f"trainer_world_size={n}", f"engine.num_engines={n}", f"rollout.shards={n}"]
        size = [f"rollout.batch_size={batch * n}", f"rollout.max_concurrency={concurrency * n}"]
        runs.append(Run(f"colocated_dp{n}", gpus, [*dp, *size, *pool_arg], batch * n * group))
    if disaggregated and n >= 2:
        half = n // 2
        split = ["placement=disaggregated", "weight_sync=distributed", "engine.mem_fraction=null"]
        dp = [f"trainer_world_size={half}", f"engine.num_engines={half}", f"rollout.shards={half}"]
        size = [f"rollout.batch_size={batch * half}", f"rollout.max_concurrency={concurrency * half}"]
        runs.append(
            Run(f"disaggregated_{half}+{half}", gpus[: 2 * half], [*split, *dp, *size], batch * half * group)
        )
    return runs


def run_overrides(run: Run, out: Path, cache: Path, steps: int, extra: list[str]) -> list[str]:
    """The config overrides of ``run``: its output, the shared warm start, the step count, the overrides
    given for every run, then the run's own (which set its layout and scale its batch)."""
    common = [f"output_dir={out / run.name}", f"bootstrap.cache_dir={cache}", f"steps={steps}"]
    return [*common, *extra, *run.overrides]


def figures(run: Run, out: Path, wall_s: float) -> dict[str, Any]:
    """A finished run's figures, from its ``metrics.jsonl`` and ``summary.json``."""
    rows = read_metrics(out / run.name / "metrics.jsonl")
    steps = [r for r in rows if "time/step_s" in r and r["step"] >= 2]
    if not steps:
        raise RuntimeError(f"{run.name}: no step past the first in {out / run.name / 'metrics.jsonl'}")
    spent = sum(r["time/step_s"] for r in steps)

    def mean(key: str) -> float:  # over the steps that report it
        return sum(r[key] for r in steps if key in r) / sum(key in r for r in steps)

    times = sorted({k for r in steps for k in r if k.startswith("time/")})
    loads = {key.replace("/", "_"): mean(key) for key in LOADS if any(key in r for r in steps)}
    summary = json.loads((out / run.name / "summary.json").read_text())
    return {
        "gpus": len(run.gpus),
        "trajectories_per_step": run.trajectories,
        "trajectories_per_s": run.trajectories * len(steps) / spent,
        "step_s": {key.removeprefix("time/"): mean(key) for key in times},
        **loads,
        "em_curve": {int(r["step"]): r[EXACT_MATCH] for r in rows if EXACT_MATCH in r},
        "em_after": summary.get("em_after"),
        "em_after_se": summary.get("em_after_se"),
        "wall_s": wall_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", help="the GPUs to use, e.g. 0,1,2,3 (default: CUDA_VISIBLE_DEVICES, else all)")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--pool", type=float, default=0.2, help="engine.mem_fraction of the colocated runs")
    ap.add_argument("--disaggregated", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_search_r1_scaling"))
    ap.add_argument("--cache", type=Path, default=Path(".cache/search_r1"), help="the shared warm start")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument(
        "overrides", nargs="*", help="config overrides for every run (rollout.batch_size: the batch a GPU)"
    )
    args = ap.parse_args()
    gpus = (args.gpus or os.environ.get("CUDA_VISIBLE_DEVICES") or _all_gpus()).split(",")
    gpus = [g for g in gpus if g]
    args.out, args.cache = args.out.resolve(), args.cache.resolve()  # the runs start in the repository root
    if not gpus:
        sys.exit("no GPU: give --gpus, set CUDA_VISIBLE_DEVICES, or run where nvidia-smi lists one")
    try:  # the one-GPU run's batch, group size and requests in flight: each generating GPU's
        rollout = load_run_config(args.config, args.overrides).rollout
    except ConfigError as err:
        sys.exit(str(err))
    batch, group, concurrency = rollout.batch_size, rollout.group_size, rollout.max_concurrency
    runs = plan(gpus, batch, group, concurrency, args.pool, args.disaggregated)
    overrides = {
        run.name: run_overrides(run, args.out, args.cache, args.steps, args.overrides) for run in runs
    }
    for run in runs:  # every run's config is valid before the first one starts
        try:
            load_run_config(args.config, overrides[run.name])
        except ConfigError as err:
            sys.exit(f"{run.name}: {err}")
    taken = [str(args.out / run.name) for run in runs if (args.out / run.name).exists()]
    if taken:  # a run appends to its metrics.jsonl: an earlier run's rows would mix into the figures
        sys.exit(f"already there (remove them or give another --out): {', '.join(taken)}")
    results: dict[str, dict[str, Any]] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    for run in runs:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(run.gpus)}
        cmd = [
            sys.executable,
            str(ROOT / "train_async.py"),
            "--config",
            str(args.config),
            *overrides[run.name],
        ]
        print(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} {' '.join(cmd)}", file=sys.stderr)
        if args.dry_run:
            continue
        t0, log_path = time.monotonic(), args.out / f"{run.name}.log"
        with log_path.open("w") as log:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        if rc != 0:
            sys.exit(f"{run.name} exited {rc}: {log_path}")
        results[run.name] = figures(run, args.out, time.monotonic() - t0)
    if args.dry_run:
        return
    print(json.dumps({"bench": "search_r1_scaling", "steps": args.steps, "runs": against_one_gpu(results)}))


def against_one_gpu(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each run's figures with ``vs_one_gpu``: its trajectories a second over the one-GPU run's."""
    base = results["one_gpu"]["trajectories_per_s"]
    return {name: {**r, "vs_one_gpu": r["trajectories_per_s"] / base} for name, r in results.items()}


def _all_gpus() -> str:
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout
    except FileNotFoundError:
        return ""
    return ",".join(line.strip() for line in listed.splitlines() if line.strip())


if __name__ == "__main__":
    main()
