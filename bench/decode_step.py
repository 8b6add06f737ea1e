"""One decode step of the embedded engine's model runner on a GPU: its modes side by side, and where a
step's GPU time goes.

A :class:`~agentrl.embedded.runner.ModelRunner` of a model shape with random weights (bf16) decodes
``--steps`` steps for ``--rows`` sequences at position ``--position`` (after warm-ups), with CUDA graphs,
in each of ``--modes`` (``default``: the engine's compiled kernels; ``batch_invariant``), in the same
process: the forward alone, without HTTP, scheduling or sampling. With ``--profile`` it also profiles
the first mode's step at the first row count (torch profiler, graphs off, so each kernel launch shows;
for an MoE shape the runner then takes its per-expert loop, not the grouped GEMMs its graphs capture):
the kernels' table goes to stderr, and the JSON line gets the GPU time a step by kernel, largest first.
Prints ONE JSON line: ms per step for each mode and row count, and the modes' ratio when both ran.

    python bench/decode_step.py [--shape qwen2.5-0.5b|qwen3-moe-1b] [--rows 64,256] [--steps 20]
        [--modes default,batch_invariant] [--profile]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

MODES: dict[str, dict[str, Any]] = {
    "default": {"compile": True},
    "batch_invariant": {"batch_invariant": True},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "qwen3-moe-1b"])
    ap.add_argument("--rows", default="64,256", help="sequences per decode step (comma-separated)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--position", type=int, default=96, help="the position each row decodes at")
    ap.add_argument(
        "--modes", default="default,batch_invariant", help="default, batch_invariant (comma-separated)"
    )
    ap.add_argument("--profile", action="store_true", help="the first mode's kernels at the first row count")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this bench needs a CUDA device (the batch-invariant kernels are Triton's)")
    import transformers

    from agentrl.embedded.runner import ModelRunner
    from agentrl.models.tiny import shape_config

    rows = [int(r) for r in a.rows.split(",") if r]
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes: pick from {', '.join(MODES)}")
    cfg = shape_config(a.shape)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    ms: dict[str, dict[str, float]] = {}
    for mode in modes:
        runner = ModelRunner(
            model, num_slots=max(rows) + 4, context_len=512, max_batch=max(rows), **MODES[mode]
        )
        ms[mode] = {}
        for b in rows:
            ids, pos = [5] * b, [a.position] * b
            for _ in range(3):
                runner.decode(ids, pos)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                runner.decode(ids, pos)
            torch.cuda.synchronize()
            ms[mode][str(b)] = round((time.perf_counter() - t0) / a.steps * 1e3, 3)
        del runner
        torch.cuda.empty_cache()
    kernels = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        runner = ModelRunner(
            model,
            num_slots=rows[0] + 4,
            context_len=512,
            max_batch=rows[0],
            cuda_graphs=False,
            **MODES[modes[0]],
        )
        for _ in range(3):
            runner.decode([5] * rows[0], [a.position] * rows[0])
        torch.cuda.synchronize()
        steps = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner.decode([5] * rows[0], [a.position] * rows[0])
            torch.cuda.synchronize()
        averages = prof.key_averages()
        print(
            averages.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=80), file=sys.stderr
        )
        kernels = kernel_times(averages, steps)
    ratio = None
    if "default" in ms and "batch_invariant" in ms:
        ratio = {b: round(ms["default"][b] / ms["batch_invariant"][b], 3) for b in ms["default"]}
    print(
        json.dumps(
            {
                "bench": "decode_step",
                "gpu": torch.cuda.get_device_name(),
                "shape": a.shape,
                "position": a.position,
                "ms_per_step": ms,
                "batch_invariant_over_default_speed": ratio,
                "profile": None
                if kernels is None
                else {"mode": modes[0], "rows": rows[0], "graphs": False, **kernels},
            }
        )
    )


def kernel_times(averages: Any, steps: int, top: int = 15) -> dict[str, Any]:
    """The GPU time a step, in all and by kernel (the ``top`` largest, ms a step and share), from a
    profiler's ``key_averages()`` over ``steps`` steps. Kernels only: the operators that launched them
    would count the same time twice."""
    rows = [
        (e.key, e.device_time_total) for e in averages if e.device_time_total > 0 and e.cpu_time_total == 0
    ]
    total = sum(t for _, t in rows) or 1.0
    rows.sort(key=lambda r: -r[1])
    return {
        "gpu_ms_per_step": round(total / steps / 1e3, 3),
        "kernels": [
            {"name": name[:120], "ms_per_step": round(t / steps / 1e3, 4), "share": round(t / total, 4)}
            for name, t in rows[:top]
        ],
    }


if __name__ == "__main__":
    main()
