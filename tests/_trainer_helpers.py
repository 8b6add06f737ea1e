"""Shared helpers of the trainer tests: deterministic trajectory batches and a spawn launcher."""

from __future__ import annotations

import os
import random
from typing import Any

from agentrl.cluster import free_port
from agentrl.types import Trajectory
from agentrl.weight_sync import WeightUpdate


def make_trajectories(
    vocab_size: int, num_groups: int = 3, group_size: int = 2, seed: int = 0, version: int = 0
) -> list[Trajectory]:
    """Multi-turn trajectories (model / observation / model turns) with rewards; logprobs are -1."""
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(3, 9))]
        for s in range(group_size):
            t = Trajectory(task_id=f"task{g}", group_id=f"g{g}", prompt_ids=list(prompt), sample_index=s)
            n1, n2 = rng.randrange(2, 7), rng.randrange(1, 5)
            t.append_model_tokens([rng.randrange(3, vocab_size) for _ in range(n1)], [-1.0] * n1, version)
            t.append_observation_tokens([rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 4))])
            t.append_model_tokens([rng.randrange(3, vocab_size) for _ in range(n2)], [-1.0] * n2, version)
            t.reward = float(rng.random())
            out.append(t)
    return out


def offset_rollout_logprobs(trajs: list[Trajectory], logprobs: list[list[float]]) -> None:
    """Rollout logprobs slightly off ``logprobs`` (the trainer's), so that TIS weights and the mismatch
    metrics are non-trivial."""
    for t, lp in zip(trajs, logprobs, strict=True):
        t.rollout_logprobs = [
            (x + 0.05 * ((i % 3) - 1)) * m for i, (x, m) in enumerate(zip(lp, t.loss_mask, strict=True))
        ]


def moe_expert_parallel_worker(
    rank: int, world: int, port: int, model_dir: str, out: str, grouped: bool
) -> None:
    """One rank of an MoE trainer with expert parallelism ``world`` (SequentialMLP or grouped experts): one
    train step; rank 0 saves the metrics, the HF weights gathered over the ranks (twice: the second time
    the other ranks keep nothing), the count of its SequentialMLP experts and the shapes of its stacked
    expert weights."""
    import warnings

    import torch

    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    warnings.filterwarnings("ignore")
    dist_env(rank, world, port)
    # no balancing loss: it is a per-micro-batch statistic, and the runs split the batch differently
    cfg = TrainerConfig(
        model_path=model_dir,
        lr=1e-3,
        micro_batch_size=2,
        ep=world,
        moe={"aux_loss_coef": 0.0, "grouped_gemm": grouped},
    )
    tr = MegatronTrainer(cfg)
    trajs = make_trajectories(tr.arch.vocab_size, num_groups=4, seed=3)
    offset_rollout_logprobs(trajs, tr.compute_logprobs(trajs))
    names = [n for n, _ in tr.module.named_parameters()]
    experts = sum(".local_experts." in n and n.endswith("linear_fc1.weight") for n in names)
    stacked = [tuple(p.shape) for n, p in tr.module.named_parameters() if n.endswith("experts.fc1_weight")]
    metrics = tr.train_step(trajs)
    weights = tr.hf_state_dict()  # gathered over the expert-parallel ranks
    # again, the other ranks taking part without keeping anything (a sync's ranks that push nothing)
    kept = tr.hf_state_dict("cpu" if rank == 0 else None)
    assert rank == 0 or kept == {}, f"rank {rank} kept {len(kept)} tensors"
    if rank == 0:
        saved = {"metrics": metrics, "weights": weights, "kept": kept}
        torch.save({**saved, "local_experts": experts, "stacked": stacked}, out)
    tr.shutdown()


def spawn_ranks(fn: Any, world: int, *args: Any) -> None:
    """``fn(rank, world, port, *args)`` in ``world`` processes that meet at a store this process hosts
    on ``port`` (torchelastic's agent store: every rank a client of it), so no rank has to bind a port
    found free earlier, which another process may have taken meanwhile."""
    import torch.multiprocessing as mp

    from agentrl.engine.dist import host_store

    store = host_store(world)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # inherited by the spawned ranks
    try:
        mp.spawn(fn, args=(world, store.port, *args), nprocs=world, join=True)
    finally:
        del os.environ["TORCHELASTIC_USE_AGENT_STORE"]


_BROADCASTER = r"""
import json, os, sys, torch
from safetensors.torch import load_file
from agentrl.engine.dist import destroy_process_group, host_store, init_custom_process_group
path, names, group = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
store = host_store(2, timeout=120)
print(f"port {store.port}", flush=True)
pg = init_custom_process_group("gloo", "", world_size=2, rank=0, group_name=group, timeout=120, store=store)
weights = load_file(path)
for name in names:
    torch.distributed.broadcast(weights[name], src=0, group=pg)
destroy_process_group(pg)  # a gloo group left alive at exit aborts the interpreter
print("broadcast done", flush=True)
# gloo's transport threads can race interpreter teardown ("terminate called without an active
# exception"); the work is done and flushed, so leave without running it
os._exit(0)
"""


async def start_broadcaster(weights: str, names: list[str], group: str) -> tuple[Any, int]:
    """A trainer-side process (rank 0 of a two-rank gloo group ``group``) that broadcasts the tensors
    ``names`` of the safetensors file ``weights`` in order, prints ``broadcast done`` and exits. Returns
    the process and the port of the store it hosts (bound before it is named, so no other process can
    hold it); the engine joins there as rank 1."""
    import asyncio
    import json
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _BROADCASTER,
        weights,
        json.dumps(names),
        group,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
    if not line.startswith("port "):
        proc.kill()
        rest = (await proc.communicate())[0].decode()
        raise AssertionError(f"the broadcaster did not start:\n{line}{rest}")
    return proc, int(line.split()[1])


def dist_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


async def sync_to_disk(tr: Any, out_dir: str) -> int:
    """A weight sync of trainer ``tr`` in disk mode with no engine: the HF dir is written, the version
    goes up by one (collective). Returns the new version."""
    await tr.connect_engines(WeightUpdate("disk", out_dir=out_dir))
    try:
        return await tr.sync_weights()
    finally:
        await tr.disconnect_engines()


def run_training_job(model_dir: str, ckpt_dir: str, total_steps: int, out: str, resume: bool) -> None:
    """A tiny training job (one process, gloo): a checkpoint after every step, a disk weight sync every
    other step, data a function of the step number. Prints ``CKPT <step>`` after each checkpoint."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    dist_env(0, 1, free_port())
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(
        model_path=model_dir,
        lr=1e-3,
        micro_batch_size=2,
        num_mini_batches=2,
        lr_warmup_steps=2,
        lr_decay_steps=8,
        lr_decay_style="cosine",
        weight_decay=0.01,
    )
    tr = MegatronTrainer(cfg)
    if resume and MegatronTrainer.latest_checkpoint(ckpt_dir) is not None:
        tr.load_checkpoint(ckpt_dir)
    while tr.step < total_steps:
        trajs = make_trajectories(tr.arch.vocab_size, seed=100 + tr.step, version=tr.policy_version)
        # rollout logprobs perturbed by RNG draws: a resumed run must restore the RNG state to match
        for t in trajs:
            t.rollout_logprobs = [(-1.0 + 0.1 * torch.rand(()).item()) * m for m in t.loss_mask]
        tr.train_step(trajs)
        if tr.step % 2 == 0:
            import asyncio

            asyncio.run(sync_to_disk(tr, f"{ckpt_dir}/hf_latest"))
        tr.save_checkpoint(ckpt_dir)
        print(f"CKPT {tr.step}", flush=True)
    torch.save(
        {"weights": tr.hf_state_dict(), "version": tr.policy_version, "step": tr.step, "lr": tr.current_lr()},
        out,
    )
    tr.shutdown()
