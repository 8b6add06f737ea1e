"""The GPUs of the test process, named the way a child process it starts must name them."""

from __future__ import annotations

import os


def child_gpu_env(index: int) -> dict[str, str]:
    """The environment entry that gives a child process this process's GPU ``index``. The child's
    ``CUDA_VISIBLE_DEVICES`` names the machine's GPUs, not this process's: under
    ``CUDA_VISIBLE_DEVICES=2,3`` this process's GPU 1 is the machine's GPU 3."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return {"CUDA_VISIBLE_DEVICES": str(index)}
    if index >= len(visible):
        raise ValueError(
            f"GPU {index} asked for, but CUDA_VISIBLE_DEVICES={','.join(visible)} gives {len(visible)}"
        )
    return {"CUDA_VISIBLE_DEVICES": visible[index].strip()}
