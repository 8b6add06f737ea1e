"""Colocation on one GPU: weight sync in memory against disk, and the GPU memory of each phase.

``python bench/colocate.py`` (one GPU) runs, for SmolLM2-135M-Instruct (converted from its GGUF) and a
randomly initialised model of Qwen2.5-0.5B's shape, a Megatron trainer in this process and an embedded
engine process on the same GPU (``--mem-fraction``, default 0.7, of the memory free when it starts), and
measures:

* weight sync: ``/update_weights_from_disk`` (HF safetensors) and ``/update_weights_from_tensor`` (CUDA
  IPC handles), ``--repeats`` each, the median seconds of the trainer's whole call;
* colocated steps as ``train_async.py`` runs them with ``colocation.mode: turns`` (engine release
  all, trainer offload): engine release, trainer onload, a train step, engine weights back, the sync in
  memory, trainer offload, engine KV cache back (median seconds of each);
* GPU memory in each phase: per process from ``nvidia-smi`` (the engine and this trainer) and torch's own
  view (the trainer's allocated / reserved, the engine's as it reports it);
* CPU Adam (``trainer.optimizer_cpu_offload``) against GPU Adam on the same batches: the trainer's GPU
  memory after a step and the step's seconds.

Prints one JSON line. On a CPU-only machine it exits with a message (the CPU paths are in
tests/test_colocate.py).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def nvidia_smi() -> dict[str, Any]:
    """Used GPU memory (MiB): in total, and per process id as nvidia-smi lists them."""
    out: dict[str, Any] = {}
    try:
        total = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
        out["total_mib"] = int(total[0]) if total else None
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        out["per_pid_mib"] = {
            int(p): int(m) for p, m in (line.split(",") for line in apps.strip().splitlines() if "," in line)
        }
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        out["error"] = str(err)
    return out


def build_05b(out: Path) -> Path:
    """A random model of Qwen2.5-0.5B's shape, bf16, with the tiny model's tokenizer files."""
    import transformers

    from agentrl.models.tiny import QWEN25_05B, build_tiny_model

    build_tiny_model(out / "tok", arch="qwen2")
    cfg = transformers.Qwen2Config(**QWEN25_05B, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(out / "tok" / f, out / f)
    return out


def batch(vocab: int, n: int, prompt: int, response: int, seed: int, version: int) -> list:
    from agentrl.types import Trajectory

    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = Trajectory(
            task_id=f"t{i // 8}",
            group_id=f"g{i // 8}",
            prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt)],
        )
        t.append_model_tokens([rng.randrange(3, vocab) for _ in range(response)], [-1.0] * response, version)
        t.reward = rng.random()
        out.append(t)
    return out


def make_trainer(model_dir: Path, **cfg: Any) -> Any:
    from agentrl.cluster import free_port

    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    return MegatronTrainer(
        TrainerConfig(
            model_path=str(model_dir), device="cuda", dtype="bfloat16", lr=1e-6, micro_batch_size=8, **cfg
        )
    )


def gib(x: float) -> float:
    return round(x / 2**30, 3)


async def memory(phase: str, client: Any, engine_pid: int) -> dict[str, Any]:
    torch.cuda.synchronize()
    smi = nvidia_smi()
    per = smi.get("per_pid_mib", {})
    info = (await client.server_info())[0]
    return {
        "phase": phase,
        "nvidia_smi_total_gib": round((smi.get("total_mib") or 0) / 1024, 2),
        "nvidia_smi_engine_gib": round(per[engine_pid] / 1024, 2) if engine_pid in per else None,
        "nvidia_smi_trainer_gib": round(per[os.getpid()] / 1024, 2) if os.getpid() in per else None,
        "torch_trainer_allocated_gib": gib(torch.cuda.memory_allocated()),
        "torch_trainer_reserved_gib": gib(torch.cuda.memory_reserved()),
        "torch_engine_allocated_gib": round(info.get("allocated_gpu_mem_gb", 0.0), 3),
        "engine_released": info.get("released"),
    }


async def one_shape(name: str, model_dir: Path, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from agentrl.embedded.launch import start_embedded_server
    from agentrl.engine.client import EngineClient
    from agentrl.weight_sync import WeightUpdate

    server = start_embedded_server(
        model_dir,
        device="cuda",
        dtype="bfloat16",
        max_batch_size=a.engine_batch,
        timeout=900,
        extra_args=["--mem-fraction", str(a.mem_fraction), "--warmup-len", str(a.warmup_len), "--no-compile"],
        log_file=work / f"engine_{name}.log",
    )
    client = EngineClient(server.url, timeout=900)
    trainer = make_trainer(model_dir)
    res: dict[str, Any] = {}
    try:
        info = (await client.server_info())[0]
        res["engine_memory_mode"] = info.get("memory_mode")
        res["engine_kv_cache_gib"] = gib(info.get("kv_cache_bytes", 0))
        res["engine_weights_gib"] = gib(info.get("weights_bytes", 0))
        mem = [await memory("start: both resident", client, server.pid)]
        vocab = trainer.arch.vocab_size
        step = 0

        def train() -> dict:
            nonlocal step
            step += 1
            return trainer.train_step(
                batch(vocab, a.batch, a.prompt_len, a.response_len, step, trainer.policy_version)
            )

        await asyncio.to_thread(train)  # the first step compiles; not timed

        async def sync(mode: str, **where: Any) -> float:  # the sync alone is timed, not the connect
            await trainer.connect_engines(WeightUpdate(mode, **where), client)
            t0 = time.perf_counter()
            await trainer.sync_weights()
            seconds = time.perf_counter() - t0
            await trainer.disconnect_engines()
            return seconds

        disk, tensor = [], []
        for _ in range(a.repeats):
            disk.append(await sync("disk", out_dir=work / f"hf_{name}"))
            tensor.append(await sync("tensor"))
        res["sync_disk_s"] = statistics.median(disk)
        res["sync_tensor_s"] = statistics.median(tensor)
        res["sync_tensor_pack_s"] = trainer.last_sync_stats["pack_seconds"]
        res["sync_bytes"] = int(trainer.last_sync_stats["num_bytes"])
        res["disk_over_tensor"] = res["sync_disk_s"] / res["sync_tensor_s"]

        # colocated steps: train_async's order with colocation.mode turns (release all, offload)
        phases: dict[str, list[float]] = {}

        async def timed(key: str, call: Any) -> Any:
            t0 = time.perf_counter()
            out = await call
            phases.setdefault(key, []).append(time.perf_counter() - t0)
            return out

        await asyncio.to_thread(trainer.offload)
        await trainer.connect_engines(WeightUpdate("tensor"), client)
        for i in range(a.repeats):
            if i == a.repeats - 1:
                mem.append(await memory("generate: engine awake, trainer offloaded", client, server.pid))
            await timed("engine_release_s", client.release_memory_occupation())
            await timed("trainer_onload_s", asyncio.to_thread(trainer.onload))
            await timed("train_step_s", asyncio.to_thread(train))
            if i == a.repeats - 1:
                mem.append(await memory("train: engine released, trainer onloaded", client, server.pid))
            await timed("engine_resume_weights_s", client.resume_memory_occupation(["weights"]))
            await timed("weight_sync_tensor_s", trainer.sync_weights())
            await timed("trainer_offload_s", asyncio.to_thread(trainer.offload))
            await timed("engine_resume_kv_s", client.resume_memory_occupation(["kv_cache"]))
        await trainer.disconnect_engines()
        res["colocated_step_phases_s"] = {k: round(statistics.median(v), 4) for k, v in phases.items()}
        res["memory"] = mem
        await asyncio.to_thread(trainer.onload)
        ok = await client.health()
        res["engine_healthy_after"] = ok
    finally:
        await client.close()
        server.stop()
        trainer.shutdown()
    return res


def cpu_adam(model_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    """GPU Adam against CPU Adam: the trainer's GPU memory after a step and the step's seconds."""
    out: dict[str, Any] = {}
    for offload in (False, True):
        gc.collect()  # megatron's DDP sits in a reference cycle: the last trainer's memory goes only now
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        trainer = make_trainer(model_dir, optimizer_cpu_offload=offload)
        try:
            vocab = trainer.arch.vocab_size
            times = []
            for s in range(a.repeats + 1):
                b = batch(vocab, a.batch, a.prompt_len, a.response_len, 100 + s, trainer.policy_version)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                trainer.train_step(b)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            key = "cpu_adam" if offload else "gpu_adam"
            out[f"{key}_step_s"] = statistics.median(times[1:])
            out[f"{key}_allocated_gib"] = gib(torch.cuda.memory_allocated() - base)
            out[f"{key}_peak_gib"] = gib(torch.cuda.max_memory_allocated() - base)
        finally:
            trainer.shutdown()
            del trainer
    out["gpu_memory_saved_gib"] = round(out["gpu_adam_allocated_gib"] - out["cpu_adam_allocated_gib"], 3)
    out["step_cost"] = out["cpu_adam_step_s"] / out["gpu_adam_step_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes", default="smollm2-135m,qwen2.5-0.5b", help="comma-separated: smollm2-135m, qwen2.5-0.5b"
    )
    p.add_argument(
        "--mem-fraction", type=float, default=0.7, help="engine KV cache share of the free GPU memory"
    )
    p.add_argument("--engine-batch", type=int, default=64, help="engine max batch size")
    p.add_argument("--warmup-len", type=int, default=512, help="engine: CUDA graph lengths captured at start")
    p.add_argument("--batch", type=int, default=32, help="trajectories per train step")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-cpu-adam", action="store_true")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/colocate.py needs a GPU (the CPU paths are tested in tests/test_colocate.py)")
    work = Path(tempfile.mkdtemp(prefix="agentrl-colocate-"))
    result: dict[str, Any] = {
        "bench": "colocate",
        "gpu": torch.cuda.get_device_name(),
        "gpu_total_gib": gib(torch.cuda.get_device_properties(0).total_memory),
        "torch": torch.__version__,
        "mem_fraction": a.mem_fraction,
        "batch": f"{a.batch} x ({a.prompt_len} + {a.response_len})",
        "shapes": {},
    }
    try:
        for shape in a.shapes.split(","):
            if shape == "smollm2-135m":
                from agentrl.models.pretrained import convert

                model_dir = convert("smollm2-135m-instruct", dtype="bfloat16")
            elif shape == "qwen2.5-0.5b":
                model_dir = build_05b(work / "qwen05b")
            else:
                sys.exit(f"--shapes: unknown shape {shape!r}")
            result["shapes"][shape] = asyncio.run(one_shape(shape, model_dir, a, work))
            if not a.skip_cpu_adam:
                result["shapes"][shape]["adam"] = cpu_adam(model_dir, a)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
