"""Megatron trainer throughput (tokens/s, MFU) and weight-sync time to the embedded engine.

GPU: ``python bench/trainer_gpu.py --device cuda`` builds a randomly initialised model of Qwen2.5-0.5B's
shape (151,936 vocab, 24 layers, hidden 896, GQA 14/2, tied embeddings), trains it in bf16 on one GPU
(megatron-core GPTModel, DDP + distributed optimizer) with the full RL step (π_old recompute, TIS, PPO),
and measures in the same run the baseline: transformers' model of the same shape, same micro-batches,
forward + backward + fused AdamW. Then it starts the embedded engine (``--engine-device``, default the
same GPU) and times a weight sync from disk (save HF safetensors + ``update_weights_from_disk``) and by
distributed broadcast (NCCL when the engine sits on another GPU, else gloo through host memory, since
NCCL cannot join two processes on one GPU), and checks the engine's logprobs against the trainer's.

``--true-on-policy`` then trains the same batches again with π_old and the loss's logprobs from
``trainer.true_on_policy``'s forward (the engine's batch-invariant kernels, agentrl.trainer.true_on_policy)
in steps interleaved with default ones, and reports the ratio of the two modes' median step times
(``--deterministic-backward`` adds the deterministic mode's steps, whose attention backward is torch's math
kernel).

``--shape qwen3-moe-1b`` (16 experts, top-2) runs the experts grouped (``trainer.moe.grouped_gemm``, auto:
on CUDA); ``--moe-grouped-gemm false`` times megatron-core's ``SequentialMLP`` experts instead.

``--world-size N`` (with ``--tp T``, default 1) then trains the same shape and batches again on N GPUs
(T-way tensor parallel, N/T data parallel; one process per GPU, spawned here), after the one-GPU run has
freed its GPU, and reports it under ``parallel`` beside the one-GPU figures of the same run
(``parallel_over_one_gpu``: the ratio of their step tokens/s). ``--tp T`` alone runs on T GPUs.

CPU: ``python bench/trainer_gpu.py`` runs the tiny test model as a smoke check (``--world-size 2``: two
gloo processes). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from trainer_gpu_modes import long_tail, make_batch, sync, true_on_policy

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}


def build_model(shape: str, dtype: str, out: Path) -> Path:
    """A random model of ``shape`` (drawn on the GPU when there is one)."""
    from agentrl.models.random_weights import build_shape_model

    return build_shape_model(shape, out, dtype, "cuda" if torch.cuda.is_available() else "cpu")


def flops_per_token(arch, seq: int) -> float:
    """Training FLOPs per token: 6 x (matmul params incl. the LM head) + causal attention (6 L s d_q). An MoE
    model counts the parameters a token uses: its k experts and the router (active-parameter FLOPs)."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_kv_heads * hd
    mlp = 3 * h * arch.ffn_hidden_size if arch.moe is None else arch.moe.active_ffn_params(h)
    per_layer = h * (q + 2 * kv) + q * h + mlp
    matmul = arch.num_layers * per_layer + arch.vocab_size * h
    return 6.0 * matmul + 6.0 * arch.num_layers * seq * q


def hf_baseline(
    model_dir: Path, trajs: list, micro: int, device: str, dtype: torch.dtype, steps: int
) -> float:
    """tokens/s of transformers' model: forward, masked token NLL, backward, AdamW, same micro-batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.startswith("cuda"))
    batches = []
    for i in range(0, len(trajs), micro):
        chunk = trajs[i : i + micro]
        ids = torch.tensor([t.input_ids for t in chunk], device=device)
        batches.append(ids)

    def step() -> int:
        n = 0
        for ids in batches:
            logits = model(ids[:, :-1]).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            (-lp.mean()).backward()
            n += ids[:, :-1].numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return n

    step()
    sync(device)
    t0 = time.perf_counter()
    tokens = sum(step() for _ in range(steps))
    sync(device)
    rate = tokens / (time.perf_counter() - t0)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rate


async def weight_sync(
    trainer, model_dir: Path, engine_device: str, dtype: str, work: Path, tokens_check: int
) -> dict:
    from agentrl.embedded.launch import start_embedded_server
    from agentrl.engine.client import EngineClient
    from agentrl.engine.types import SamplingParams
    from agentrl.types import Trajectory
    from agentrl.weight_sync import BroadcastGroup, WeightUpdate

    out: dict = {}
    server = start_embedded_server(
        model_dir,
        device=engine_device.split(":")[0],
        dtype=dtype,
        timeout=900,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": engine_device.split(":")[1]}
        if ":" in engine_device
        else None,
    )
    client = EngineClient(server.url, timeout=3600)
    try:
        await trainer.connect_engines(WeightUpdate("disk", out_dir=work / "hf_sync"), client)
        t0 = time.perf_counter()
        await trainer.sync_weights()
        out["sync_disk_s"] = time.perf_counter() - t0
        await trainer.disconnect_engines()

        same_gpu = (
            trainer.device.type != "cuda"
            or ":" not in engine_device
            or engine_device == f"cuda:{trainer.device.index}"
        )
        backend = "gloo" if same_gpu else "nccl"
        t0 = time.perf_counter()
        await trainer.connect_engines(
            WeightUpdate("distributed", group=BroadcastGroup(backend=backend)), client
        )
        out["sync_group_init_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        version = await trainer.sync_weights()
        out["sync_distributed_s"] = time.perf_counter() - t0
        out["sync_distributed_backend"] = backend
        out["sync_distributed_buckets"] = int(trainer.last_sync_stats["num_buckets"])
        out["sync_bytes"] = int(trainer.last_sync_stats["num_bytes"])
        out["disk_over_distributed"] = out["sync_disk_s"] / out["sync_distributed_s"]

        # consistency after the broadcast: engine μ vs trainer π on sampled tokens
        trajs = []
        for i in range(4):
            t = Trajectory(task_id=str(i), group_id="g", prompt_ids=list(range(10 + i, 42 + i)))
            r = await client.generate(
                t.prompt_ids, SamplingParams(max_new_tokens=tokens_check, temperature=1.0, ignore_eos=True)
            )
            t.append_model_tokens(r.output_ids, r.logprobs, version)
            out["engine_weight_version"] = r.weight_version
            trajs.append(t)
        diffs = [
            abs(a - b)
            for t, lp in zip(trajs, trainer.compute_logprobs(trajs), strict=True)
            for a, b in zip(lp, t.rollout_logprobs, strict=True)
        ]
        out["logprob_abs_diff_max"] = max(diffs)
        out["logprob_abs_diff_mean"] = sum(diffs) / len(diffs)
        t0 = time.perf_counter()
        out["sync_group_closed_cleanly"] = await trainer.disconnect_engines(timeout=60)
        out["sync_group_close_s"] = time.perf_counter() - t0
    finally:
        await trainer.disconnect_engines(timeout=60)
        await client.close()
        server.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--engine-device", default=None, help="engine device (default: the trainer's; cuda:1 for NCCL)"
    )
    p.add_argument(
        "--shape",
        default=None,
        choices=["tiny", "tiny-moe", "qwen2.5-0.5b", "qwen3-moe-1b"],
        help="default: tiny on cpu, qwen2.5-0.5b on cuda; qwen3-moe-1b: 16 experts top-2, 0.96B (0.30B "
        "active); tiny-moe: the MoE test model (8 experts top-2), a CPU smoke check of the MoE path",
    )
    p.add_argument("--batch", type=int, default=None, help="trajectories per train step")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--response-len", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed train steps (after one warm-up)")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="GPU bf16 dense peak (default: from the GPU name)"
    )
    p.add_argument(
        "--logprob-chunk", type=int, default=None, help="TrainerConfig.logprob_chunk_tokens (chunked LM head)"
    )
    p.add_argument(
        "--max-tokens-per-micro-batch", type=int, default=None, help="token-budget micro-batches instead"
    )
    p.add_argument(
        "--pack", action="store_true", help="packed micro-batches (needs --max-tokens-per-micro-batch)"
    )
    p.add_argument(
        "--long-tail",
        action="store_true",
        help="also train a long-tail batch (lognormal response lengths, same total tokens) padded and packed",
    )
    p.add_argument(
        "--pack-budget",
        type=int,
        default=None,
        help="--long-tail: real tokens per packed micro-batch "
        "(default micro-batch size x (prompt + response))",
    )
    p.add_argument(
        "--old-logprobs",
        default="auto",
        choices=["auto", "recompute"],
        help="TrainerConfig.old_logprobs (recompute: a separate π_old pass even with one optimizer step)",
    )
    p.add_argument(
        "--compile-kernels",
        default=None,
        choices=["on", "off"],
        help="TrainerConfig.compile_kernels (default: on CUDA)",
    )
    p.add_argument("--compile-layers", action="store_true", help="TrainerConfig.compile_layers")
    p.add_argument(
        "--moe-grouped-gemm",
        default="auto",
        choices=["auto", "true", "false"],
        help="TrainerConfig.moe.grouped_gemm (MoE shapes; auto: grouped-GEMM experts on CUDA)",
    )
    p.add_argument(
        "--true-on-policy", action="store_true", help="also time the steps with TrainerConfig.true_on_policy"
    )
    p.add_argument(
        "--deterministic-backward",
        action="store_true",
        help="with --true-on-policy: also time the deterministic mode's route (math attention backward)",
    )
    p.add_argument("--skip-sync", action="store_true")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="also train on this many GPUs (processes on the CPU), after the one-GPU run (default: --tp)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of the --world-size run")
    a = p.parse_args()
    a.world_size = a.world_size or a.tp
    if a.world_size % a.tp:
        p.error(f"--world-size {a.world_size} is not a multiple of --tp {a.tp}")
    cuda = a.device == "cuda"
    shape = a.shape or ("qwen2.5-0.5b" if cuda else "tiny")
    dtype = "bfloat16" if cuda else "float32"
    batch = a.batch or (32 if cuda else 8)
    plen = a.prompt_len or (256 if cuda else 16)
    rlen = a.response_len or (768 if cuda else 32)
    engine_device = a.engine_device or ("cuda:0" if cuda else "cpu")

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from agentrl.cluster import free_port
    from agentrl.trainer.trainer import MegatronTrainer

    os.environ["MASTER_PORT"] = str(free_port())
    work = Path(tempfile.mkdtemp(prefix="agentrl-bench-trainer-"))
    try:
        model_dir = build_model(shape, dtype, work / "model")
        trainer = MegatronTrainer(trainer_config(a, model_dir, dtype))
        vocab = min(trainer.arch.vocab_size, 150000)
        trajs = make_batch(batch, plen, rlen, vocab, group=8, seed=0)
        rates, step_times, metrics = timed_steps(trainer, a, batch, plen, rlen, vocab)
        seq = plen + rlen - 1
        tokens_per_step = batch * seq
        update_rate = sum(rates) / len(rates)
        fpt = flops_per_token(trainer.arch, seq)
        result: dict = {
            "bench": "trainer_gpu",
            "device": a.device,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "shape": shape,
            "dtype": dtype,
            "params": trainer.arch.num_params(),
            "batch": batch,
            "seq_len": seq,
            "micro_batch_size": a.micro_batch_size,
            "megatron_core": _mcore_version(),
            "update_tokens_per_s": update_rate,
            "step_tokens_per_s": tokens_per_step / (sum(step_times) / len(step_times)),
            "step_s": sum(step_times) / len(step_times),
            "old_logprob_s": metrics.get("old_logprob_seconds"),
            "grad_norm": metrics.get("grad_norm"),
            "trained_tokens": trained_tokens(metrics),
            "logprob_chunk_tokens": a.logprob_chunk,
            "max_tokens_per_micro_batch": a.max_tokens_per_micro_batch,
            "pack_sequences": a.pack,
            "old_logprobs": a.old_logprobs,
            "compile_layers": a.compile_layers,
            "compile_kernels": a.compile_kernels or ("on" if cuda else "off"),
            "grouped_experts": trainer.grouped_experts,  # MoE: GroupedExperts, else SequentialMLP
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        }
        peak = a.peak_tflops or next(
            (v for k, v in PEAK_BF16_TFLOPS.items() if cuda and k in torch.cuda.get_device_name()), None
        )
        if peak:
            result["mfu"] = update_rate * fpt / (peak * 1e12)
            result["peak_tflops"] = peak
        result["model_tflops_per_s"] = update_rate * fpt / 1e12
        if a.long_tail:
            result["long_tail"] = long_tail(trainer, a, batch, plen, rlen, vocab)
        if a.true_on_policy:
            result["true_on_policy"] = true_on_policy(trainer, a, batch, plen, rlen, vocab)
        if not a.skip_baseline:
            try:
                hf_rate = hf_baseline(
                    model_dir,
                    trajs,
                    a.micro_batch_size,
                    f"cuda:{trainer.device.index}" if cuda else "cpu",
                    getattr(torch, dtype),
                    max(1, a.steps - 1),
                )
            except torch.OutOfMemoryError:  # transformers keeps full fp32 logits: a baseline's own limit
                result["hf_baseline_error"] = f"out of memory at micro-batch {a.micro_batch_size}"
            else:
                result["hf_baseline_tokens_per_s"] = hf_rate
                result["megatron_over_hf"] = update_rate / hf_rate
        if not a.skip_sync:
            result.update(asyncio.run(weight_sync(trainer, model_dir, engine_device, dtype, work, 16)))
            result["engine_device"] = engine_device
        trainer.shutdown()
        if a.world_size > 1:
            del trainer
            if cuda:
                torch.cuda.empty_cache()  # the parallel run gets this GPU whole
            result["parallel"] = parallel(a, model_dir, dtype, batch, plen, rlen, vocab)
            result["parallel_over_one_gpu"] = (
                result["parallel"]["step_tokens_per_s"] / result["step_tokens_per_s"]
            )
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def trainer_config(a: argparse.Namespace, model_dir: Path, dtype: str, tp: int = 1) -> Any:
    from agentrl.trainer.config import TrainerConfig

    cuda = a.device == "cuda"
    return TrainerConfig(
        model_path=str(model_dir),
        device=a.device,
        dtype=dtype,
        lr=1e-6,
        micro_batch_size=a.micro_batch_size,
        vocab_divisible_by=128 if cuda else 1,
        logprob_chunk_tokens=a.logprob_chunk,
        max_tokens_per_micro_batch=a.max_tokens_per_micro_batch,
        pack_sequences=a.pack,
        old_logprobs=a.old_logprobs,
        compile_layers=a.compile_layers,
        compile_kernels=None if a.compile_kernels is None else a.compile_kernels == "on",
        moe={"grouped_gemm": a.moe_grouped_gemm},
        tp=tp,
    )


def trained_tokens(metrics: dict) -> int:
    """Tokens one step trained on, counted by the trainer over all data-parallel ranks."""
    return round(metrics["tokens_per_s"] * metrics["update_seconds"])


def timed_steps(trainer, a, batch: int, plen: int, rlen: int, vocab: int) -> tuple[list, list, dict]:
    """One warm-up step, then ``a.steps`` timed ones on fresh batches: the trainer's tokens/s per step,
    the steps' wall times, the last step's metrics."""
    trainer.train_step(make_batch(batch, plen, rlen, vocab, group=8, seed=0))  # warm-up
    sync(a.device)
    rates, step_times, metrics = [], [], {}
    for s in range(a.steps):
        step_batch = make_batch(batch, plen, rlen, vocab, group=8, seed=s + 1)  # a batch from the buffer
        t0 = time.perf_counter()
        metrics = trainer.train_step(step_batch)
        sync(a.device)
        step_times.append(time.perf_counter() - t0)
        rates.append(metrics["tokens_per_s"])
    return rates, step_times, metrics


def parallel(a, model_dir: Path, dtype: str, batch: int, plen: int, rlen: int, vocab: int) -> dict:
    """The same steps on ``a.world_size`` GPUs (processes on the CPU), ``a.tp``-way tensor parallel and
    data parallel over the rest; every rank gets the whole batch and trains its data-parallel share, as
    the ranks of a run do. Rank 0's figures."""
    import torch.multiprocessing as mp

    from agentrl.cluster import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=parallel_rank, args=(r, port, a, model_dir, dtype, batch, plen, rlen, vocab, results)
        )
        for r in range(a.world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        out = results.get(timeout=3600)
        if "error" in out:
            raise RuntimeError(f"rank {out['rank']} failed:\n{out['error']}")
        for proc in procs:
            proc.join(timeout=300)
    except queue.Empty:
        raise RuntimeError("the parallel run gave no result within an hour") from None
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return out


def parallel_rank(
    rank: int,
    port: int,
    a,
    model_dir: Path,
    dtype: str,
    batch: int,
    plen: int,
    rlen: int,
    vocab: int,
    results: Any,
) -> None:
    """One rank of :func:`parallel` (its own process): rank 0 puts the figures (or any rank its error)."""
    world = a.world_size
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        from agentrl.trainer.trainer import MegatronTrainer

        trainer = MegatronTrainer(trainer_config(a, model_dir, dtype, tp=a.tp))
        rates, step_times, metrics = timed_steps(trainer, a, batch, plen, rlen, vocab)
        step_s = sum(step_times) / len(step_times)
        figures = {
            "world_size": world,
            "tp": a.tp,
            "dp": world // a.tp,
            "update_tokens_per_s": sum(rates) / len(rates),
            "step_tokens_per_s": batch * (plen + rlen - 1) / step_s,
            "step_s": step_s,
            "grad_norm": metrics.get("grad_norm"),
            "trained_tokens": trained_tokens(metrics),
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None,
        }
        trainer.shutdown()
        if rank == 0:
            results.put(figures)
    except Exception:
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise


def _mcore_version() -> str:
    import megatron.core

    return megatron.core.__version__


if __name__ == "__main__":
    sys.exit(main())
