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


# the variable scripts/gpu_test.sh hands the test workers: each worker's GPUs, ``0,1;2;3`` (worker gw0 holds
# the machine's GPUs 0 and 1, gw1 GPU 2, gw2 GPU 3)
TEST_GPUS_ENV = "AGENTRL_TEST_GPUS"


def worker_gpus(gpus: list[str], largest: int = 2) -> list[list[str]]:
    """The GPUs of each test worker when a GPU test run is spread over ``gpus`` (the machine's ids), for
    tests that need up to ``largest`` GPUs: the first worker holds that many (all there are, if fewer),
    every other GPU is a worker of its own (``["0", "1", "2", "3"]``, 2 -> ``[["0", "1"], ["2"], ["3"]]``).
    No GPU is shared between two workers, so a test that measures its device's free memory sees only its
    own."""
    if not gpus:
        return []
    first = max(1, min(largest, len(gpus)))
    return [list(gpus[:first]), *([g] for g in gpus[first:])]


def format_layout(layout: list[list[str]]) -> str:
    """``[["0", "1"], ["2"]]`` -> ``"0,1;2"`` (the value of :data:`TEST_GPUS_ENV`)."""
    return ";".join(",".join(w) for w in layout)


def parse_layout(value: str) -> list[list[str]]:
    """``"0,1;2"`` -> ``[["0", "1"], ["2"]]``; ``""`` -> ``[]``."""
    return [parse_gpu_list(w) for w in value.split(";") if w.strip()]


def gpus_of_worker(worker_id: str, layout: list[list[str]]) -> list[str]:
    """The GPUs of pytest-xdist worker ``worker_id`` (``gw0``, ``gw1``, ...) in ``layout``. A ValueError for a
    worker the layout has no GPUs for (more workers than it)."""
    index = int(worker_id.removeprefix("gw"))
    if index >= len(layout):
        raise ValueError(
            f"worker {worker_id}: the GPU layout {format_layout(layout)} has {len(layout)} workers"
        )
    return layout[index]


def parse_gpu_list(value: str) -> list[str]:
    """``"0, 1,3"`` -> ``["0", "1", "3"]`` (the form of ``CUDA_VISIBLE_DEVICES``)."""
    return [g.strip() for g in value.split(",") if g.strip()]


# scripts/gpu_test.sh: python -m agentrl.testing.gpus GPU_LIST LARGEST -> the layout
if __name__ == "__main__":
    import sys

    print(format_layout(worker_gpus(parse_gpu_list(sys.argv[1]), int(sys.argv[2]))))
