"""What ``deterministic: true`` costs: the same small Search-R1 run (synthetic world, tiny model, CPU)
through ``train_async.py`` with the switch off and on, one after the other in the same bench run.

Deterministic mode runs each batch whole under one policy version, waits for it before a weight update
instead of interrupting it, and serves with the embedded engine's batch-invariant kernels
(``--batch-invariant``: a request's logprobs do not depend on what else the engine batches or caches, so
batching and prefix reuse stay on). The figures: mean step time (wait for the batch + train + sync),
trained trajectories per second over the RL steps and generated tokens per second; ratios are
deterministic / default.

Prints one JSON line.

    python bench/deterministic.py [--steps 8] [--batch-size 4] [--group-size 4] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrl.testing.configs import TINY_SEARCH_R1

ROOT = Path(__file__).resolve().parent.parent

CONFIG = (
    TINY_SEARCH_R1
    + """output_dir: {out}
steps: {steps}
deterministic: {deterministic}
engine: {{max_batch_size: {engine_batch}}}
rollout: {{group_size: {group_size}, batch_size: {batch_size}, max_staleness: 1, max_concurrency: 64,
          max_turns: 3, max_total_tokens: 600, sampling: {{temperature: 1.0, max_new_tokens: 24}},
          eval_sampling: {{temperature: 0.0, max_new_tokens: 24}},
          verifier: "agentrl.testing.verifiers:length_parity", filter_zero_variance: false}}
trainer: {{device: cpu, lr: 1.0e-4, micro_batch_size: 8}}
eval: {{num_tasks: {eval_tasks}, after: false}}
"""
)


def run(
    mode: str, deterministic: bool, work: Path, a: argparse.Namespace, engine_batch: int = 64
) -> dict[str, float]:
    out = work / mode
    cfg = work / f"{mode}.yaml"
    cfg.write_text(
        CONFIG.format(
            out=out,
            cache=work / "cache",
            steps=a.steps,
            deterministic=str(deterministic).lower(),
            group_size=a.group_size,
            batch_size=a.batch_size,
            eval_tasks=a.eval_tasks,
            engine_batch=engine_batch,
        )
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "train_async.py", "--config", str(cfg)], cwd=ROOT, capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "policy_version" in r]
    rl_s = sum(r["time/step_s"] for r in steps)
    trajs = a.steps * a.batch_size * a.group_size
    tokens = sum(r["rollout/model_tokens"] for r in steps)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return {
        "mean_step_s": round(rl_s / len(steps), 3),
        "trajectories_per_s": round(trajs / rl_s, 3),
        "generated_tokens_per_s": round(tokens / rl_s, 1),
        "staleness_mean": round(sum(r["batch/staleness_mean"] for r in steps) / len(steps), 3),
        "run_wall_s": round(time.monotonic() - t0, 1),
        "summary_wall_s": round(float(summary["wall_s"]), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4, help="groups per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--eval-tasks", type=int, default=16)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="pairs of runs, the order alternating (default first, then deterministic first, ...); the "
        "ratios are the medians of the rounds' ratios, so one run slowed by a neighbour moves them less",
    )
    a = p.parse_args()
    rounds: list[tuple[dict[str, float], dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="agentrl_bench_") as tmp:  # removed at the end of the run
        work = Path(tmp)
        run("warmup", False, work, argparse.Namespace(**{**vars(a), "steps": 1}))  # bootstrap, caches
        for r in range(a.rounds):
            first_det = r % 2 == 1
            one = run(f"{r}_first", first_det, work, a)
            two = run(f"{r}_second", not first_det, work, a)
            rounds.append((two, one) if first_det else (one, two))

    def ratio(key: str, det: dict[str, float], default: dict[str, float]) -> float:
        return det[key] / default[key]

    def median_ratio(key: str) -> float:
        return round(statistics.median(ratio(key, det, default) for default, det in rounds), 2)

    default, det = rounds[0]
    out: dict[str, Any] = {
        "bench": "deterministic",
        "steps": a.steps,
        "batch": f"{a.batch_size} groups x {a.group_size}",
        "rounds": a.rounds,
        "default": default if a.rounds == 1 else [d for d, _ in rounds],
        "deterministic": det if a.rounds == 1 else [d for _, d in rounds],
        "step_time_ratio": median_ratio("mean_step_s"),
        "throughput_ratio": median_ratio("trajectories_per_s"),
        "run_wall_ratio": median_ratio("run_wall_s"),
    }
    if a.rounds > 1:
        out["throughput_ratios"] = [round(ratio("trajectories_per_s", d, b), 2) for b, d in rounds]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
