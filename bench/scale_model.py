"""The scale model of one RL step past one host, from the command line: its predictions for N hosts x 8
GPUs at 7B, 30B-A3B and 235B-A22B (step, parts, bottleneck, the engine/trainer split), its check
against every measured 1-, 2- and 4-GPU point, and a summary, one JSON line each.

The model (inputs and parts): bench/scale_parts.py; the measured points: bench/scale_points.py; the
reasoning and the tables: docs/design/scale-model.md.

    python bench/scale_model.py [--hosts 1,2,4,8,16] [--shapes ...] [--trajectories 512] [--inputs]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from scale_parts import SHAPES, ScaleInputs, Workload, predict
from scale_points import check_points


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", default="1,2,4,8,16", help="host counts (8 GPUs each)")
    p.add_argument("--shapes", default="qwen2.5-7b,qwen3-30b-a3b,qwen3-235b-a22b", help=", ".join(SHAPES))
    p.add_argument("--trajectories-per-gpu", type=int, default=64, help="the batch a GPU (weak scaling)")
    p.add_argument("--trajectories", type=int, default=None, help="a fixed batch a step (strong scaling)")
    p.add_argument("--mfu-moe", type=float, default=ScaleInputs.mfu_moe, help="the MoE trainer's MFU")
    p.add_argument("--inputs", action="store_true", help="also print the inputs table, one line each")
    a = p.parse_args()
    inp = ScaleInputs(mfu_moe=a.mfu_moe)
    w = Workload(trajectories_per_gpu=a.trajectories_per_gpu, trajectories=a.trajectories)
    if a.inputs:
        for row in inp.table():  # the input's own kind (measured, fit, vendor, assumption) as input_kind
            fields = {"input_kind" if k == "kind" else k: v for k, v in row.items()}
            print(json.dumps({"bench": "scale_model", "kind": "input", **fields}))
    for name in a.shapes.split(","):
        for hosts in (int(h) for h in a.hosts.split(",")):
            for placement in ("colocated", "disaggregated", "async"):
                row = predict(SHAPES[name], hosts, placement, w, inp)
                print(json.dumps({"bench": "scale_model", "kind": "prediction", **row}))
    rows = check_points(inp)
    for row in rows:
        print(json.dumps({"bench": "scale_model", "kind": "check", **row}))
    checked = [r for r in rows if r["role"] == "check"]
    summary = {
        "bench": "scale_model",
        "kind": "summary",
        "workload": dataclasses.asdict(w),
        "points": len(rows),
        "fit_points": len(rows) - len(checked),
        "checked": len(checked),
        "within_15pct": sum(r["within"] for r in checked),
        "misses": [f"{r['what']} ({r['source']})" for r in rows if not r["within"]],
        "max_abs_error_fit": max(abs(r["error"]) for r in rows if r["role"] == "fit"),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
