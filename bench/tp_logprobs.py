"""Tensor-parallel logprobs against one rank's: how far the Megatron trainer's π logprobs move when the same
model runs ``--tp N`` ways split.

One random-weight model (bench/trainer_gpu.py's shapes, built the same way) and one fixed batch of
trajectories; the trainer's π logprobs (``MegatronTrainer.compute_logprobs``, the path of π_old) are
computed with tp=1 in this process (one GPU, ``cuda:0``), then with tp=N over N ranks spawned here (rank r
on ``cuda:r`` under NCCL; gloo processes on the CPU), each twice. Reported over the sampled tokens
(``loss_mask``), per pair of runs: max and mean |Δ log p|, the fraction of tokens exactly equal and the k3
estimate of KL(π_tpN ‖ π_tp1) (``exp(-d) - 1 + d`` with ``d = log π_tpN - log π_tp1``, as the trainer's
mismatch KL). ``tp1_vs_tp1`` and ``tp_vs_tp`` compare each side's two runs: the run-to-run noise floor
(0 where the kernels are deterministic). ``--train-step`` adds one RL train step on each side from the
same weights: the two losses and the updated weights' max |Δ|. Wall times: each call on each side (the
first one includes torch.compile's warm-up of the logprob kernels on a GPU).

Not bit-exact even in fp32 on the CPU: a row-parallel linear (attention output, MLP down projection) gives
the all-reduced sum of N GEMMs over K/N inputs each, rounded differently from one GEMM over all K (its
inputs agree bit for bit; its output differs in the last bit), and the vocabulary-parallel log-softmax
sums Σexp over N shards. The tiny fp32 model's logprobs differ by ~1e-6 at most, a quarter of its
tokens not exactly equal; each side alone is bit-for-bit repeatable on the CPU.

GPU (N GPUs): ``python bench/tp_logprobs.py --device cuda --dtype bfloat16 --shape qwen2.5-0.5b --tp 2``

CPU: ``python bench/tp_logprobs.py`` (tiny model, float32, two gloo ranks). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from trainer_gpu import build_model
from trainer_gpu_modes import make_batch, sync


def trainer_config(a: argparse.Namespace, model_dir: Path, tp: int) -> Any:
    """The trainer's config, the same on both sides but for ``tp``."""
    from agentrl.trainer.config import TrainerConfig

    return TrainerConfig(
        model_path=str(model_dir),
        device=a.device,
        dtype=a.dtype,
        tp=tp,
        lr=a.lr,
        micro_batch_size=a.micro_batch_size,
        vocab_divisible_by=128 if a.device == "cuda" else 1,
    )


def measure(a: argparse.Namespace, model_dir: Path, tp: int) -> dict[str, Any]:
    """On every rank of a ``tp``-way trainer: the batch's π logprobs twice, then (``--train-step``) one
    train step and the HF weights it leaves (gathered over the ranks)."""
    from agentrl.trainer.trainer import MegatronTrainer

    trainer = MegatronTrainer(trainer_config(a, model_dir, tp))
    vocab = min(trainer.arch.vocab_size, 150000)
    batch = make_batch(a.batch, a.prompt_len, a.response_len, vocab, group=8, seed=a.seed)
    out: dict[str, Any] = {"loss_mask": [t.loss_mask for t in batch], "logprobs": [], "logprobs_s": []}
    for _ in range(2):
        sync(a.device)
        t0 = time.perf_counter()
        out["logprobs"].append(trainer.compute_logprobs(batch))
        sync(a.device)
        out["logprobs_s"].append(time.perf_counter() - t0)
    if a.train_step:
        before = trainer.hf_state_dict()
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch)
        sync(a.device)
        out["train_step_s"] = time.perf_counter() - t0
        out["loss"], out["grad_norm"] = metrics["loss"], metrics.get("grad_norm")
        out["weights"] = trainer.hf_state_dict()
        out["update_abs_max"] = max_abs_diff(before, out["weights"])
    trainer.shutdown()
    return out


def tp_rank(rank: int, port: int, a: argparse.Namespace, model_dir: Path, out: Path) -> None:
    """One rank of the tp=N trainer (its own process, ``cuda:rank`` on a GPU); rank 0 saves its figures."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(a.tp),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    result = measure(a, model_dir, a.tp)
    if rank == 0:
        torch.save(result, out)


def compare(lp_a: list[list[float]], lp_b: list[list[float]], masks: list[list[int]]) -> dict[str, float]:
    """``b`` against ``a`` over the tokens the mask keeps: |Δ log p| max and mean, the fraction exactly
    equal, and the k3 estimate of KL(b ‖ a)."""
    d = [
        y - x
        for xs, ys, m in zip(lp_a, lp_b, masks, strict=True)
        for x, y, keep in zip(xs, ys, m, strict=True)
        if keep
    ]
    n = len(d)
    return {
        "logprob_abs_diff_max": max(abs(v) for v in d),
        "logprob_abs_diff_mean": sum(abs(v) for v in d) / n,
        "exact_fraction": sum(v == 0.0 for v in d) / n,
        "kl_k3": sum(math.expm1(-v) + v for v in d) / n,  # expm1: no cancellation at tiny d
    }


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise ValueError(f"different weight names: {sorted(set(a) ^ set(b))[:5]}")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on cuda")
    p.add_argument(
        "--shape",
        default=None,
        choices=["tiny", "tiny-moe", "qwen2.5-0.5b", "qwen3-moe-1b"],
        help="bench/trainer_gpu.py's shapes (default: tiny on cpu, qwen2.5-0.5b on cuda)",
    )
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size compared with one rank")
    p.add_argument("--batch", type=int, default=None, help="trajectories (default 32 on cuda, 8 on cpu)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 on cuda, 16 on cpu")
    p.add_argument("--response-len", type=int, default=None, help="default 768 on cuda, 32 on cpu")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="seed of the batch (the weights' seed is fixed)")
    p.add_argument("--train-step", action="store_true", help="also one train step on each side")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of --train-step")
    a = p.parse_args()
    cuda = a.device == "cuda"
    if a.tp < 2:
        p.error("--tp must be at least 2 (it is compared with tp=1)")
    if cuda and torch.cuda.device_count() < a.tp:
        p.error(f"--tp {a.tp} needs {a.tp} GPUs; {torch.cuda.device_count()} visible")
    a.shape = a.shape or ("qwen2.5-0.5b" if cuda else "tiny")
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    a.batch = a.batch or (32 if cuda else 8)
    a.prompt_len = a.prompt_len or (256 if cuda else 16)
    a.response_len = a.response_len or (768 if cuda else 32)

    from agentrl.cluster import free_port

    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="agentrl-bench-tp-logprobs-"))
    try:
        model_dir = build_model(a.shape, a.dtype, work / "model")
        one = measure(a, model_dir, 1)
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()  # rank 0 of the tp run gets this GPU
        mp.spawn(tp_rank, args=(free_port(), a, model_dir, work / "tp.pt"), nprocs=a.tp, join=True)
        many = torch.load(work / "tp.pt", weights_only=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if many["loss_mask"] != one["loss_mask"]:
        raise RuntimeError("the two sides built different batches")
    masks = one["loss_mask"]
    import megatron.core

    result: dict[str, Any] = {
        "bench": "tp_logprobs",
        "device": a.device,
        "gpus": [torch.cuda.get_device_name(r) for r in range(a.tp)] if cuda else None,
        "dtype": a.dtype,
        "shape": a.shape,
        "tp": a.tp,
        "batch": a.batch,
        "prompt_len": a.prompt_len,
        "response_len": a.response_len,
        "seed": a.seed,
        "megatron_core": megatron.core.__version__,
        "tokens_compared": sum(map(sum, masks)),
        "tp_vs_tp1": compare(one["logprobs"][0], many["logprobs"][0], masks),
        "tp1_vs_tp1": compare(one["logprobs"][0], one["logprobs"][1], masks),
        "tp_vs_tp": compare(many["logprobs"][0], many["logprobs"][1], masks),
        "wall_s": {"tp1_logprobs": one["logprobs_s"], "tp_logprobs": many["logprobs_s"]},
    }
    if a.train_step:
        result["train_step"] = {
            "loss_tp1": one["loss"],
            "loss_tp": many["loss"],
            "loss_abs_diff": abs(one["loss"] - many["loss"]),
            "grad_norm_tp1": one["grad_norm"],
            "grad_norm_tp": many["grad_norm"],
            "weights_abs_diff_max": max_abs_diff(one["weights"], many["weights"]),
            "update_abs_max_tp1": one["update_abs_max"],  # the step's own size, for scale
        }
        result["wall_s"].update(tp1_train_step=one["train_step_s"], tp_train_step=many["train_step_s"])
    result["wall_s"]["total"] = time.perf_counter() - t_start
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
