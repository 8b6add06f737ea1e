"""The GPUs of the test processes: how scripts/gpu_test.sh lays its workers over a machine's GPUs
(:func:`worker_gpus`), and a GPU of the test process named the way a child process it starts must name it
(:func:`child_gpu_env`)."""

from __future__ import annotations

import os


def child_gpu_env(index: int) -> dict[str, str]:
    """The environment entry that gives a child process this process's GPU ``index``. The child's
    ``CUDA_VISIBLE_DEVICES`` names the machine's GPUs, not this process's: under
    ``CUDA_VISIBLE_DEVICES=2,3`` this process's GPU 1 is the machine's GPU 3."""
    visible = parse_gpu_list(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    if not visible:
        return {"CUDA_VISIBLE_DEVICES": str(index)}
    if index >= len(visible):
        raise ValueError(
            f"GPU {index} asked for, but CUDA_VISIBLE_DEVICES={','.join(visible)} gives {len(visible)}"
        )
    return {"CUDA_VISIBLE_DEVICES": visible[index]}


# the variable scripts/gpu_test.sh hands the test workers: the machine's GPU ids it spreads them over
TEST_GPUS_ENV = "AGENTRL_TEST_GPUS"


def worker_gpus(gpus: list[str]) -> list[list[str]]:
    """The GPUs of each test worker when a GPU test run is spread over ``gpus`` (the machine's ids):
    the first worker holds a pair, for the tests that need two GPUs, and every other GPU is a worker of
    its own (``["0", "1", "2", "3"]`` -> ``[["0", "1"], ["2"], ["3"]]``); one GPU is one worker. No GPU is
    shared between two workers, so a test that measures its device's free memory sees only its own."""
    if len(gpus) <= 1:
        return [list(gpus)] if gpus else []
    return [list(gpus[:2]), *([g] for g in gpus[2:])]


def gpus_of_worker(worker_id: str, gpus: list[str]) -> list[str]:
    """The GPUs of pytest-xdist worker ``worker_id`` (``gw0``, ``gw1``, ...) in :func:`worker_gpus`'s
    layout over ``gpus``. A ValueError for a worker the layout has no GPUs for (more workers than it)."""
    layout = worker_gpus(gpus)
    index = int(worker_id.removeprefix("gw"))
    if index >= len(layout):
        raise ValueError(
            f"worker {worker_id}: {len(gpus)} GPUs make {len(layout)} workers; run at most that many (-n)"
        )
    return layout[index]


def parse_gpu_list(value: str) -> list[str]:
    """``"0, 1,3"`` -> ``["0", "1", "3"]`` (the form of ``CUDA_VISIBLE_DEVICES``)."""
    return [g.strip() for g in value.split(",") if g.strip()]
