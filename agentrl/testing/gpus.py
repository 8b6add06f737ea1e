"""The GPUs of the test processes: how scripts/gpu_test.sh lays its pytest runs and their workers over a
machine's GPUs (:func:`suite_phases`, :func:`worker_gpus`), and a GPU of the test process named the way a
child process it starts must name it (:func:`child_gpu_env`)."""

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


# the variable scripts/gpu_test.sh hands each of its pytest runs: which tests that run takes (``one``: those
# needing one GPU; ``many``: those needing more; unset: all)
TEST_PHASE_ENV = "AGENTRL_TEST_PHASE"


def suite_phases(gpus: list[str], largest: int = 2) -> list[tuple[str, list[list[str]]]]:
    """The pytest runs of the GPU suite on ``gpus`` and each run's worker GPUs, for tests needing up to
    ``largest`` GPUs: ``(phase, layout)`` pairs, the phase being what :data:`TEST_PHASE_ENV` says.

    With two or more GPUs and a test needing more than one: first the one-GPU tests with every GPU a
    worker of its own, then the multi-GPU tests with workers of ``largest`` GPUs each (as many as fit; all
    the GPUs if fewer), so that no GPU waits while a pair finishes the one-GPU work: ``["0", "1", "2", "3"]``
    -> ``[("one", [["0"], ["1"], ["2"], ["3"]]), ("many", [["0", "1"], ["2", "3"]])]``.
    Otherwise one run of everything: ``[("", worker_gpus(gpus, largest))]``."""
    if len(gpus) < 2 or largest < 2:
        return [("", worker_gpus(gpus, largest))] if gpus else []
    width = min(largest, len(gpus))
    pairs = [list(gpus[i : i + width]) for i in range(0, len(gpus) - width + 1, width)]
    return [("one", [[g] for g in gpus]), ("many", pairs)]


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


# scripts/gpu_test.sh: python -m agentrl.testing.gpus GPU_LIST LARGEST -> one line a pytest run,
# "PHASE LAYOUT" (PHASE "-" for a run of every test)
if __name__ == "__main__":
    import sys

    for phase, layout in suite_phases(parse_gpu_list(sys.argv[1]), int(sys.argv[2])):
        print(phase or "-", format_layout(layout))
