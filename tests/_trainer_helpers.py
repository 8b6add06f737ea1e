"""Shared helpers of the trainer tests: deterministic trajectory batches and a spawn launcher."""

from __future__ import annotations

import os
import random
import socket

from agentrl.types import Trajectory


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
