"""How far fp8 rollout moves the engine's logprobs from the trainer's: the mismatch token TIS corrects.

Two embedded engines serve the same checkpoint in the same dtype, one with ``quantization: fp8``
(:mod:`agentrl.embedded.fp8`). The fp8 engine samples the responses (temperature 1, seeded), as a rollout
would, and its logprobs are the rollout's. The unquantized engine scores the same tokens through its own
prefill and decode steps, and the trainer's side is the model's full-sequence forward (transformers, in
the engine's dtype: the function the trainer computes, without its own kernels' small differences). Per
engine, against the trainer's logprobs, over every response token:

* ``mismatch_kl``: the k3 estimate of KL(engine ‖ trainer), ``exp(-d) - 1 + d`` with ``d = logp_engine -
  logp_train``, as :func:`agentrl.trainer.losses.off_policy_weights` logs it;
* ``max_abs_dlogp``: the largest ``|d|``;
* ``tis_min/mean/max/std``: the token-TIS weights ``min(exp(logp_train - logp_engine), tis_cap)``.

Prints one JSON line. Without ``--model`` a tiny random Qwen2 model is built (CPU smoke runs).

    python bench/fp8_mismatch.py [--device cpu|cuda] [--model DIR] [--prompts 8] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from agentrl.embedded.engine import EmbeddedEngine
from agentrl.embedded.runner import ExtendBatch, ModelRunner
from agentrl.embedded.sampling import RequestSampling
from agentrl.trainer.losses import LossConfig


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: a tiny random Qwen2 model)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="engine dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tis-cap", type=float, default=LossConfig().tis_cap, help="TIS cap (the loss's default)")
    return p.parse_args(argv)


def _scored(runner: ModelRunner, prompt: list[int], response: list[int]) -> list[float]:
    """Logprobs of ``response`` after ``prompt`` through the runner's own steps: the prompt's prefill,
    then one decode step per token, as the engine computed them when it generates (slot 0)."""
    logits = [runner.extend(ExtendBatch([0], [prompt], [0]))[0].clone()]
    for j, tok in enumerate(response[:-1]):
        logits.append(runner.decode([tok], [len(prompt) + j])[0].clone())
    lp = torch.log_softmax(torch.stack(logits).float(), dim=-1)
    return lp[torch.arange(len(response)), torch.tensor(response, device=lp.device)].tolist()


def _train_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> list[float]:
    """The trainer's logprobs of ``response``: one forward of the whole sequence."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + response], device=device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(response)), torch.tensor(response, device=device)].tolist()


def _figures(engine: list[float], train: list[float], cap: float) -> dict[str, float]:
    e, t = torch.tensor(engine, dtype=torch.float64), torch.tensor(train, dtype=torch.float64)
    d = e - t
    w = torch.exp(t - e).clamp(max=cap)
    return {
        "mismatch_kl": float((torch.exp(-d) - 1 + d).mean()),
        "max_abs_dlogp": float(d.abs().max()),
        "tis_min": float(w.min()),
        "tis_mean": float(w.mean()),
        "tis_max": float(w.max()),
        "tis_std": float(w.std()),
    }


async def _sample(engine: EmbeddedEngine, prompts: list[list[int]], n: int, seed: int) -> list[Any]:
    sp = [
        RequestSampling(temperature=1.0, max_new_tokens=n, ignore_eos=True, sampling_seed=seed + i)
        for i in range(len(prompts))
    ]
    return await asyncio.gather(
        *(engine.generate(p, s, f"r{i}") for i, (p, s) in enumerate(zip(prompts, sp, strict=True)))
    )


def run(a: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    context = max(64, -(-(a.prompt_len + a.max_new_tokens) // 16) * 16)
    # two engines and the model in one process: each engine's KV cache sized to the run, not the GPU
    kw: dict[str, Any] = dict(
        device=a.device,
        dtype=dtype,
        max_batch_size=max(a.prompts, 1),
        prefix_cache_slots=0,
        context_len=context,
    )
    fp8 = EmbeddedEngine(model_dir, quantization="fp8", **kw)
    base = EmbeddedEngine(model_dir, **kw)
    try:
        rng = random.Random(a.seed)
        vocab = min(fp8.vocab_size, 32000)
        prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
        t0 = time.perf_counter()
        records = asyncio.run(_sample(fp8, prompts, a.max_new_tokens, a.seed))
        gen_s = time.perf_counter() - t0
        responses = [list(r.output_ids) for r in records]
        fp8_lp = [lp for r in records for lp in r.logprobs]
        base_lp = [
            lp
            for p, r in zip(prompts, responses, strict=True)
            for lp in base._device_thread.submit(_scored, base.runner, p, r).result()
        ]
        quantize_s = fp8.stats["quantize_s"]
    finally:
        fp8.shutdown()
        base.shutdown()
    del fp8, base  # their device memory goes before the model's forward
    gc.collect()
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    model = (
        AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(a.device).eval()
    )
    train_lp = [lp for p, r in zip(prompts, responses, strict=True) for lp in _train_logprobs(model, p, r)]
    fp8_vs_train = _figures(fp8_lp, train_lp, a.tis_cap)
    base_vs_train = _figures(base_lp, train_lp, a.tis_cap)
    return {
        "bench": "fp8_mismatch",
        "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(),
        "dtype": dtype,
        "model": str(model_dir) if a.model else "tiny-qwen2",
        "prompts": a.prompts,
        "tokens": len(train_lp),
        "tis_cap": a.tis_cap,
        "quantize_s": quantize_s,
        "generate_s": gen_s,
        "fp8": fp8_vs_train,
        "unquantized": base_vs_train,
        "fp8_vs_unquantized_max_abs_dlogp": float(
            (torch.tensor(fp8_lp, dtype=torch.float64) - torch.tensor(base_lp, dtype=torch.float64))
            .abs()
            .max()
        ),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = _parse(argv)
    if a.model:
        out = run(a, Path(a.model))
    else:
        from agentrl.models.tiny import build_tiny_model

        with tempfile.TemporaryDirectory(prefix="agentrl-fp8-bench-") as tmp:
            out = run(a, build_tiny_model(tmp, arch="qwen2", seed=a.seed))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
