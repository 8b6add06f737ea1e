"""One decode step of the embedded engine's model runner, batch-invariant against default, on a GPU.

A :class:`~agentrl.embedded.runner.ModelRunner` of a model shape with random weights (bf16) decodes
``--steps`` steps for ``--rows`` sequences at position ``--position`` (after warm-ups), with CUDA graphs,
once with the default kernels (compiled) and once in batch-invariant mode, in the same process: the
forward alone, without HTTP, scheduling or sampling. With ``--profile`` it also prints the
batch-invariant step's kernels (torch profiler, graphs off) to stderr. Prints ONE JSON line: ms per step
for each mode and row count, and their ratio.

    python bench/decode_step.py [--shape qwen2.5-0.5b] [--rows 64,256] [--steps 20] [--profile]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b"])
    ap.add_argument("--rows", default="64,256", help="sequences per decode step (comma-separated)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--position", type=int, default=96, help="the position each row decodes at")
    ap.add_argument("--profile", action="store_true", help="print the batch-invariant step's kernels")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this bench needs a CUDA device (the batch-invariant kernels are Triton's)")
    import transformers

    from agentrl.embedded.runner import ModelRunner
    from agentrl.models.tiny import QWEN25_05B

    rows = [int(r) for r in a.rows.split(",") if r]
    cfg = transformers.Qwen2Config(**QWEN25_05B, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    ms: dict[str, dict[str, float]] = {}
    for mode, kw in (("default", {"compile": True}), ("batch_invariant", {"batch_invariant": True})):
        runner = ModelRunner(model, num_slots=max(rows) + 4, context_len=512, max_batch=max(rows), **kw)
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
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        runner = ModelRunner(model, num_slots=rows[0] + 4, context_len=512, max_batch=rows[0], cuda_graphs=False,
                             batch_invariant=True)  # fmt: skip
        runner.decode([5] * rows[0], [a.position] * rows[0])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.decode([5] * rows[0], [a.position] * rows[0])
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60),
              file=sys.stderr)  # fmt: skip
    print(json.dumps({
        "bench": "decode_step",
        "gpu": torch.cuda.get_device_name(),
        "shape": a.shape,
        "position": a.position,
        "ms_per_step": ms,
        "batch_invariant_over_default_speed": {
            b: round(ms["default"][b] / ms["batch_invariant"][b], 3) for b in ms["default"]
        },
    }))  # fmt: skip


if __name__ == "__main__":
    main()
