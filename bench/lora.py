"""LoRA against full fine-tuning on one device: trainable parameters, step time, peak memory, and what a
weight sync moves and how long it takes.

For each mode (``full``, then ``lora`` with ``--rank``) a process of its own builds the Megatron trainer
on a model of ``--shape`` (random weights written once, shared by both), trains ``--steps`` timed steps
after one warm-up on the same synthetic batches, then gathers what a sync pushes (the full HF-named
weights, or the PEFT-named adapters) and, with ``--engine``, pushes it in memory (``weight_sync:
tensor``) to an embedded engine started on the same device after the steps (its KV cache held to
``--engine-mem-fraction`` of the free memory), three times, and checks that the engine serves the new
version; it also times greedy generation (``--gen-requests`` requests of ``--gen-tokens`` tokens at once)
before the first sync and after the last. LoRA does this once per ``--lora-apply`` (default both, one
engine after the other, each with buffers of ``--rank`` as a run starts them): ``unmerged`` serves the
adapters beside the weights, a sync copying them into buffers; ``merged`` merges them into the weights
from host copies of the base (:mod:`agentrl.embedded.lora`). A mode that runs out of GPU memory is
reported as ``"fits": false`` with the error's first line: a full fine-tune of the 7B shape does not fit
one 80 GB GPU (bf16 weights and gradients, fp32 master weights and two Adam moments: 16 bytes a
parameter), its LoRA does.

    python bench/lora.py --device cuda --shape qwen2.5-7b --engine        # one GPU
    python bench/lora.py --device cuda --shape smollm2-135m --engine --rank 32
    python bench/lora.py --shape smollm2-135m --engine --rank 32 --steps 1   # CPU, a real model's shape
    python bench/lora.py                                                 # CPU: the tiny model (CI)

Prints ONE JSON line: the two modes side by side, ``lora_over_full`` ratios where both fit, and with both
LoRA applies ``unmerged_over_merged`` (sync and generation).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from trainer_gpu_modes import make_batch, sync

from agentrl.models.random_weights import build_shape_model

# the dense shapes LoRA is measured on (agentrl.models.tiny.FULL_SHAPES; "tiny": the CPU default)
SHAPES = ("tiny", "smollm2-135m", "qwen2.5-0.5b", "qwen2.5-7b")


def run_mode(a: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """One mode in this process: the trainer's figures, or ``fits: false`` on running out of memory."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from agentrl.cluster import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    cuda = a.device == "cuda"
    out: dict[str, Any] = {"mode": a.mode}
    try:
        out.update(asyncio.run(_train_and_sync(a, model_dir)))
        out["fits"] = True
    except torch.cuda.OutOfMemoryError as err:
        out.update(fits=False, error=str(err).splitlines()[0][:300])
    if cuda:
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


async def _train_and_sync(a: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    cuda = a.device == "cuda"
    lora = {"rank": a.rank, "alpha": 2.0 * a.rank} if a.mode == "lora" else None
    cfg = TrainerConfig(
        model_path=str(model_dir),
        device=a.device,
        dtype="bfloat16" if cuda else "float32",
        lr=1e-5,
        micro_batch_size=a.micro_batch_size,
        vocab_divisible_by=128 if cuda else 1,
        lora=lora,
    )
    trainer = MegatronTrainer(cfg)
    out: dict[str, Any] = {
        "params": trainer.arch.num_params(),
        "trainable_params": sum(p.numel() for p in trainer.module.parameters() if p.requires_grad),
    }
    vocab = min(trainer.arch.vocab_size, 150000)
    trainer.train_step(make_batch(a.batch, a.prompt_len, a.response_len, vocab, group=8, seed=0))  # warm-up
    sync(a.device)
    times = []
    for s in range(a.steps):
        batch = make_batch(a.batch, a.prompt_len, a.response_len, vocab, group=8, seed=s + 1)
        t0 = time.perf_counter()
        trainer.train_step(batch)
        sync(a.device)
        times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(times)
    out["train_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None

    t0 = time.perf_counter()
    pushed = trainer.lora_state_dict() if lora else trainer.hf_state_dict(trainer.device)
    out["gather_s"] = time.perf_counter() - t0
    out["sync_tensors"] = len(pushed)
    out["sync_bytes"] = sum(t.numel() * t.element_size() for t in pushed.values())
    del pushed
    if a.engine:
        out.update(await _engine_sync(a, trainer, model_dir))
    return out


async def _engine_sync(a: argparse.Namespace, trainer: Any, model_dir: Path) -> dict[str, Any]:
    """Full fine-tuning: the syncs to one engine. LoRA: to one engine per ``--lora-apply``, one after the
    other; the figures of the first (unmerged by default) at the top, every one under ``lora_apply``."""
    if a.mode == "full":
        return await _engine_syncs(a, trainer, model_dir, [])
    applies = ["unmerged", "merged"] if a.lora_apply == "both" else [a.lora_apply]
    by_apply = {}
    for apply in applies:
        by_apply[apply] = await _engine_syncs(
            a, trainer, model_dir, ["--lora-apply", apply, "--max-lora-rank", str(a.rank)]
        )
    return {**by_apply[applies[0]], "lora_apply": by_apply}


async def _engine_syncs(
    a: argparse.Namespace, trainer: Any, model_dir: Path, args: list[str]
) -> dict[str, Any]:
    """Three in-memory syncs to an embedded engine on the same device, their times (the trainer's gather
    and push apart), the version it then serves, and its generation speed before and after."""
    import httpx

    from agentrl.embedded.launch import start_embedded_server
    from agentrl.engine.client import EngineClient
    from agentrl.weight_sync import WeightUpdate

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()  # the engine sizes its KV cache from the memory free now
        args = [*args, "--mem-fraction", str(a.engine_mem_fraction)]
    server = start_embedded_server(
        model_dir,
        device=a.device,
        dtype="bfloat16" if cuda else "float32",
        timeout=900,
        extra_args=args,
        max_batch_size=max(a.gen_requests, 8),
    )
    client = EngineClient(server.url, timeout=3600)
    try:
        before = await _generation_speed(a, client, min(trainer.arch.vocab_size, 150000))
        await trainer.connect_engines(WeightUpdate("tensor"), client)
        times, gather, push = [], [], []
        for _ in range(3):
            t0 = time.perf_counter()
            version = await trainer.sync_weights()
            times.append(time.perf_counter() - t0)
            gather.append(trainer.last_sync_stats["gather_seconds"])
            push.append(trainer.last_sync_stats["seconds"])
        async with httpx.AsyncClient() as http:
            served = (await http.get(server.url + "/get_weight_version")).json()["weight_version"]
        return {
            "sync_s": statistics.median(times),
            "sync_gather_s": statistics.median(gather),
            "sync_push_s": statistics.median(push),
            "engine_weight_version": served,
            "pushed_version": version,
            "gen_tok_s_before_sync": before,
            "gen_tok_s": await _generation_speed(a, client, min(trainer.arch.vocab_size, 150000)),
        }
    finally:
        await trainer.disconnect_engines()
        await client.close()
        server.stop()


async def _generation_speed(a: argparse.Namespace, client: Any, vocab: int) -> float:
    """New tokens a second of ``--gen-requests`` greedy requests of ``--gen-tokens`` tokens sent at once: the
    best of ``--gen-rounds`` rounds after one round of warm-up (the first rounds of a fresh engine, and any
    round another process shares the cores with, run slower)."""
    import random

    from agentrl.engine.types import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(a.gen_requests)]
    sampling = SamplingParams(max_new_tokens=a.gen_tokens, temperature=0.0, ignore_eos=True)
    rates = []
    for _ in range(1 + a.gen_rounds):
        t0 = time.perf_counter()
        results = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
        rates.append(sum(len(r.output_ids) for r in results) / (time.perf_counter() - t0))
    return max(rates[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default=None, choices=SHAPES, help="default: tiny on cpu, qwen2.5-7b on cuda")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    p.add_argument("--batch", type=int, default=None, help="trajectories a step (default 8 cpu, 16 cuda)")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--response-len", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    p.add_argument("--engine", action="store_true", help="also time in-memory syncs to an embedded engine")
    p.add_argument(
        "--engine-mem-fraction", type=float, default=0.3, help="the engine's KV cache share (cuda)"
    )
    p.add_argument(
        "--lora-apply",
        default="both",
        choices=["both", "unmerged", "merged"],
        help="how the LoRA engine serves the adapters (engine.lora_apply); both: one engine each",
    )
    p.add_argument(
        "--gen-requests", type=int, default=None, help="requests generated at once (8 cpu, 64 cuda)"
    )
    p.add_argument("--gen-tokens", type=int, default=None, help="new tokens a request (64 cpu, 256 cuda)")
    p.add_argument("--gen-rounds", type=int, default=5, help="timed generation rounds (the best counts)")
    p.add_argument("--mode", default=None, choices=["full", "lora"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    cuda = a.device == "cuda"
    a.shape = a.shape or ("qwen2.5-7b" if cuda else "tiny")
    a.batch = a.batch or (16 if cuda else 8)
    a.prompt_len = a.prompt_len or (256 if cuda else 16)
    a.response_len = a.response_len or (768 if cuda else 32)
    a.gen_requests = a.gen_requests or (64 if cuda else 8)
    a.gen_tokens = a.gen_tokens or (256 if cuda else 64)
    if a.mode is not None:  # a worker: one mode, one JSON line
        print(json.dumps(run_mode(a, Path(a.model_dir))), flush=True)
        return

    work = Path(tempfile.mkdtemp(prefix="agentrl-bench-lora-"))
    try:
        # random weights (N(0, 0.02), norms 1), drawn on the GPU when there is one: a 7B model in seconds
        model_dir = build_shape_model(a.shape, work / "model", "bfloat16" if cuda else "float32", a.device)
        modes = {}
        for mode in ("full", "lora"):
            argv = [arg for arg in sys.argv[1:]] + ["--mode", mode, "--model-dir", str(model_dir)]
            proc = subprocess.run(
                [sys.executable, __file__, *argv], capture_output=True, text=True, timeout=3600
            )
            if proc.returncode != 0:
                modes[mode] = {
                    "mode": mode,
                    "fits": None,
                    "error": proc.stderr.strip().splitlines()[-1][:300],
                }
                continue
            modes[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        result: dict[str, Any] = {
            "bench": "lora",
            "device": a.device,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "shape": a.shape,
            "rank": a.rank,
            "batch": a.batch,
            "seq_len": a.prompt_len + a.response_len - 1,
            "steps": a.steps,
            **modes,
        }
        full, lora = modes["full"], modes["lora"]
        if full.get("fits") and lora.get("fits"):
            result["lora_over_full"] = {
                k: lora[k] / full[k]
                for k in ("trainable_params", "step_s", "sync_bytes", "sync_s", "peak_mem_gb")
                if full.get(k) and lora.get(k) is not None
            }
        applies = lora.get("lora_apply") or {}
        if {"unmerged", "merged"} <= set(applies):
            u, m = applies["unmerged"], applies["merged"]
            result["unmerged_over_merged"] = {k: u[k] / m[k] for k in ("sync_s", "sync_push_s", "gen_tok_s")}
        print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
