"""The trainer's process world: its device, torch.distributed plus megatron's ``tp`` x ``pp`` x dp
parallel state, the seeded RNGs (and their saved state), and the few collectives the train step uses
on metrics and scalars."""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from agentrl.trainer.losses import MetricSums

if TYPE_CHECKING:
    from agentrl.trainer.config import TrainerConfig


def resolve_device(cfg: TrainerConfig) -> torch.device:
    """``cfg.device`` made concrete: the ``LOCAL_RANK``-th GPU (made current) or the CPU."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_distributed(cfg: TrainerConfig, device: torch.device, store: Any = None) -> None:
    """torch.distributed from the env (RANK, WORLD_SIZE; default one process) and megatron's
    parallel_state for ``tp`` x ``pp`` x dp.

    The ranks meet through ``store`` when given (rank 0's from :func:`agentrl.engine.dist.host_store`,
    a client of it elsewhere), else at MASTER_ADDR:MASTER_PORT. One process alone meets nobody: it
    takes no port."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "gloo" and world > 1:  # ranks on several hosts reach rank 0's address
            from agentrl.engine.dist import use_gloo_interface_for

            use_gloo_interface_for(os.environ.get("MASTER_ADDR", ""))
        if store is None and world == 1:
            store = dist.HashStore()
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        else:
            if "MASTER_PORT" not in os.environ:
                raise RuntimeError("MASTER_PORT must be set when WORLD_SIZE > 1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            dist.init_process_group(backend, rank=rank, world_size=world)
    if dist.get_world_size() % (cfg.tp * cfg.pp):
        raise ValueError(f"world size {dist.get_world_size()} is not a multiple of tp*pp = {cfg.tp * cfg.pp}")
    if cfg.ep > 1 and dist.get_world_size() % (cfg.tp * cfg.pp * cfg.ep):
        raise ValueError(
            f"world size {dist.get_world_size()} is not a multiple of tp*pp*ep = {cfg.tp * cfg.pp * cfg.ep} "
            "(expert parallelism splits the data-parallel ranks)"
        )
    if ps.model_parallel_is_initialized():
        if (
            ps.get_tensor_model_parallel_world_size() != cfg.tp
            or ps.get_pipeline_model_parallel_world_size() != cfg.pp
            or ps.get_expert_model_parallel_world_size() != cfg.ep
        ):
            raise RuntimeError("megatron parallel_state is already initialized with other sizes")
        return
    extra = {"expert_model_parallel_size": cfg.ep} if cfg.ep > 1 else {}
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp, **extra
    )


def seed_everything(seed: int, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def comm_device(device: torch.device) -> torch.device:
    """Where small tensors for collectives live: the GPU under NCCL, the CPU under gloo."""
    return device if device.type == "cuda" else torch.device("cpu")


def all_reduce_scalar(x: float, group: Any, device: torch.device) -> float:
    """The sum of ``x`` over ``group`` (fp64)."""
    if dist.get_world_size(group) == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=comm_device(device))
    dist.all_reduce(t, group=group)
    return float(t.item())


def reduce_metrics(metrics: MetricSums, ps: Any, pp: int, device: torch.device) -> dict[str, float]:
    """Sum metric sums/counts over data-parallel ranks (on the last pipeline stage), max the maxes;
    with ``pp > 1`` the last stage's means are broadcast to every stage. ``ps``: megatron's
    parallel_state."""
    metrics.resolve()
    names = sorted(metrics.sums)
    group = ps.get_data_parallel_group()
    if dist.get_world_size(group) > 1 and names:
        t = torch.tensor(
            [[metrics.sums[k], metrics.counts[k]] for k in names],
            dtype=torch.float64,
            device=comm_device(device),
        )
        dist.all_reduce(t, group=group)
        for k, row in zip(names, t.cpu().tolist(), strict=True):
            metrics.sums[k], metrics.counts[k] = row
        mx = sorted(metrics.maxes)
        if mx:
            m = torch.tensor([metrics.maxes[k] for k in mx], dtype=torch.float64, device=comm_device(device))
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            metrics.maxes.update(zip(mx, m.cpu().tolist(), strict=True))
    out = metrics.means()
    if pp > 1:  # metrics live on the last stage; broadcast them to every stage
        obj = [out]
        dist.broadcast_object_list(
            obj,
            src=dist.get_global_rank(ps.get_pipeline_model_parallel_group(), pp - 1),
            group=ps.get_pipeline_model_parallel_group(),
        )
        out = obj[0]
    return out
