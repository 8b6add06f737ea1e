"""A run's checkpoints: the one module that writes and reads their layout.

Layout under ``ckpt_dir`` (``<output_dir>/checkpoints``):

- ``step_{N:08d}/rank_{R:05d}.pt``: trainer rank R's model shard, optimizer and LR schedule state, RNG
  state, progress counters and config; the megatron optimizer path adds its parameter state beside it,
  rank 0 a ``meta.json`` (:func:`save_checkpoint`, :func:`load_checkpoint`; collective).
- ``rollout_{N:08d}.pkl``: the rollout's state at step N (dataset cursor, tasks in flight), written by
  the driver before the trainer's files (:func:`save_rollout_state`, :func:`load_rollout_state`).
- ``latest``: names the newest complete step dir; written last, atomically, so a kill never leaves a
  torn "latest" (:func:`latest_checkpoint`).

Loading needs the same world and parallel layout. The driver's part (the rollout state, ``latest``) needs
no torch, which only the trainer's functions import.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    from agentrl.trainer.optim import TrainerOptimizer


class TrainerCounters(NamedTuple):
    """The trainer's counters that a checkpoint carries."""

    step: int  # train_step calls completed
    optimizer_steps: int
    policy_version: int  # weight syncs done


def save_checkpoint(
    ckpt_dir: str | Path,
    module: torch.nn.Module,
    optimizer: TrainerOptimizer,
    progress: TrainerCounters,
    config: dict[str, Any],
    rank: int,
    world_size: int,
) -> Path:
    """Write this rank's file of step ``progress.step`` (collective: every rank calls it), then rank 0
    points ``latest`` at it. Returns the step dir."""
    import torch
    import torch.distributed as dist

    from agentrl.trainer.distributed import rng_state

    root = Path(ckpt_dir)
    d = step_dir(root, progress.step)
    d.mkdir(parents=True, exist_ok=True)
    state = {
        "model": module.state_dict(),
        **optimizer.state_dict(),
        "rng": rng_state(),
        "step": progress.step,
        "optimizer_steps": progress.optimizer_steps,
        "policy_version": progress.policy_version,
        "config": config,
    }
    tmp = d / f"rank_{rank:05d}.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(d / f"rank_{rank:05d}.pt")
    optimizer.save_sharded_state(d)
    dist.barrier()
    if rank == 0:
        (d / "meta.json").write_text(
            json.dumps(
                {"step": progress.step, "policy_version": progress.policy_version, "world_size": world_size}
            )
        )
        tmp_latest = root / "latest.tmp"
        tmp_latest.write_text(d.name)
        tmp_latest.replace(root / "latest")
    dist.barrier()
    return d


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    """The trainer's directory of step ``step``."""
    return Path(ckpt_dir) / f"step_{step:08d}"


def save_rollout_state(ckpt_dir: str | Path, step: int, state: dict[str, Any]) -> Path:
    """Write the rollout's state of step ``step`` (before the trainer's files, which move ``latest``)."""
    path = Path(ckpt_dir) / f"rollout_{step:08d}.pkl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(state))
    return path


def load_rollout_state(ckpt_dir: str | Path, step: int) -> dict[str, Any]:
    """The rollout's state that :func:`save_rollout_state` wrote for step ``step``."""
    return pickle.loads((Path(ckpt_dir) / f"rollout_{step:08d}.pkl").read_bytes())


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The step dir ``ckpt_dir/latest`` names, or None before the first checkpoint."""
    f = Path(ckpt_dir) / "latest"
    return Path(ckpt_dir) / f.read_text().strip() if f.is_file() else None


def load_checkpoint(
    path: str | Path, module: torch.nn.Module, optimizer: TrainerOptimizer, rank: int
) -> TrainerCounters:
    """Restore what :func:`save_checkpoint` wrote (``path``: a step dir or the root) into ``module``,
    ``optimizer`` and the RNGs (collective); returns the saved counters."""
    import torch
    import torch.distributed as dist

    from agentrl.trainer.distributed import set_rng_state

    p = Path(path)
    if (p / "latest").is_file():
        p = p / (p / "latest").read_text().strip()
    state = torch.load(p / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)
    load_local_state(module, state["model"])
    optimizer.load_state_dict(state, p)
    set_rng_state(state["rng"])
    progress = TrainerCounters(
        int(state["step"]), int(state["optimizer_steps"]), int(state["policy_version"])
    )
    dist.barrier()
    return progress


def load_local_state(module: torch.nn.Module, shard: dict[str, torch.Tensor]) -> None:
    """Copy ``shard`` into ``module`` in place; every parameter must be covered (extra_state may not)."""
    import torch

    own = module.state_dict()
    missing = [k for k in own if k not in shard and not k.endswith("_extra_state")]
    unexpected = [k for k in shard if k not in own]
    if missing or unexpected:
        raise KeyError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for k, v in shard.items():
            if k.endswith("_extra_state"):
                continue
            if own[k].shape != v.shape:
                raise ValueError(
                    f"{k}: checkpoint shape {tuple(v.shape)} != model shape {tuple(own[k].shape)}"
                )
            own[k].copy_(v)
