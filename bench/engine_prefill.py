"""Prefill speed of the embedded engine's model runner: packed tokens with attention read from the slot
cache, replaying a captured graph per token bucket (the GPU default) and eager, against the padded
rectangle through torch SDPA, in the same run.

The workload is what an agent run asks of the engine after its KV cache was released or its prefix
cache flushed (each weight update): ``--rows`` episodes in flight prefill their whole history again
(``history``: 300 to 1,500 tokens each, in steps of at most ``--max-prefill-tokens`` real tokens), then
each adds its next observation after that history in one step (``turn``: 40 to 120 tokens each;
``turn8``: eight of them, as turns arriving a few at a time are admitted). All
paths get the steps the engine's scheduler would plan for them (the padded one also caps its rectangle
at ``Scheduler.PADDED_CELLS`` x the budget). Reports tokens/s per phase and packed / padded ratios.
Prints ONE JSON line. On CPU the packed path is the kernel's torch reference, block by block: it checks
the layout, its speed means nothing.

    python bench/engine_prefill.py --device cuda --shape smollm2-135m [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from agentrl.embedded.runner import ExtendBatch, ModelRunner
from agentrl.embedded.scheduler import prefill_takes
from agentrl.models.tiny import QWEN25_05B, SMOLLM2_135M


def build(shape: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    import transformers

    if shape == "tiny":
        cfg = transformers.Qwen2Config(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    elif shape == "smollm2-135m":
        cfg = transformers.LlamaConfig(**SMOLLM2_135M)
    elif shape == "qwen2.5-0.5b":
        cfg = transformers.Qwen2Config(**QWEN25_05B)
    else:
        raise SystemExit(f"unknown --shape {shape!r}")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()


def plan(rows: list[tuple[int, list[int], int]], budget: int, padded: bool) -> list[ExtendBatch]:
    """The prefill steps the engine's scheduler plans for (slot, tokens, start) rows
    (:func:`agentrl.embedded.scheduler.prefill_takes`, step after step until every token is in)."""
    steps, todo = [], list(rows)
    while todo:
        takes = prefill_takes([len(toks) for _, toks, _ in todo], budget, padded)
        picked = todo[: len(takes)]
        steps.append(
            ExtendBatch(
                [slot for slot, _, _ in picked],
                [toks[:n] for (_, toks, _), n in zip(picked, takes, strict=True)],
                [start for _, _, start in picked],
            )
        )
        rest = [(slot, toks[n:], start + n) for (slot, toks, start), n in zip(picked, takes, strict=True)]
        todo = [r for r in rest if r[1]] + todo[len(takes) :]
    return steps


def timed(runner: ModelRunner, steps: list[ExtendBatch], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for step in steps:
            runner.extend(step)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="tiny", help="tiny, smollm2-135m, qwen2.5-0.5b")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="GPU: eager layer pieces")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    model = build(args.shape, dtype, args.device)
    vocab = int(model.config.vocab_size)
    rng = random.Random(0)
    history = [[rng.randrange(3, vocab) for _ in range(rng.randint(300, 1500))] for _ in range(args.rows)]
    obs = [[rng.randrange(3, vocab) for _ in range(rng.randint(40, 120))] for _ in range(args.rows)]
    runners = {}
    for name in ("packed_graphs", "packed", "padded"):
        graphs = name == "packed_graphs" and args.device == "cuda"
        r = ModelRunner(model, args.rows, 2048, args.rows, cuda_graphs=graphs, compile=not args.no_compile)
        if name == "padded":
            r.packed_prefill = False
        elif args.device == "cpu":
            r.packed_prefill = True  # the kernel's torch reference, block by block: a layout check only
        elif not r.packed_prefill:
            raise SystemExit(
                "the packed prefill does not serve this model's head size (or Triton is missing)"
            )
        runners[name] = r
    result: dict = {
        "bench": "engine_prefill",
        "device": args.device,
        "shape": args.shape,
        "dtype": str(dtype).removeprefix("torch."),
        "rows": args.rows,
        "max_prefill_tokens": args.max_prefill_tokens,
    }
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    phases = {
        "history": [(i, h, 0) for i, h in enumerate(history)],
        "turn": [(i, o, len(history[i])) for i, o in enumerate(obs)],
        "turn8": [(i, o, len(history[i])) for i, o in enumerate(obs[:8])],  # a few turns arriving together
    }
    for phase, rows in phases.items():
        tokens = sum(len(t) for _, t, _ in rows)
        result[f"{phase}_tokens"] = tokens
        for name, runner in runners.items():
            steps = plan(rows, args.max_prefill_tokens, padded=name == "padded")
            if phase.startswith("turn"):  # the histories are cached: prefill them once untimed
                timed(runner, plan(phases["history"], args.max_prefill_tokens, padded=name == "padded"), 1)
            timed(runner, steps, 1)  # warm-up: compiles, allocator
            s = timed(runner, steps, args.repeats)
            result[f"{phase}_{name}_steps"] = len(steps)
            result[f"{phase}_{name}_s"] = round(s, 4)
            result[f"{phase}_{name}_tokens_per_s"] = round(tokens / s)
        for name in ("packed", "packed_graphs"):
            result[f"{phase}_{name}_over_padded"] = round(
                result[f"{phase}_padded_s"] / result[f"{phase}_{name}_s"], 2
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
