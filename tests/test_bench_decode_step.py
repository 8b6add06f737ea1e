"""bench/decode_step.py on the CPU: it refuses to run without a CUDA device, and its profile summary
counts each kernel's GPU time a step once (kernels only, largest first)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("decode_step_bench", ROOT / "bench" / "decode_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_profile_summary_counts_kernels_a_step_largest_first() -> None:
    events = [
        SimpleNamespace(key="aten::mm", device_time_total=900.0, cpu_time_total=50.0),  # an operator
        SimpleNamespace(key="gemm_kernel", device_time_total=600.0, cpu_time_total=0.0),
        SimpleNamespace(key="moe_scatter", device_time_total=300.0, cpu_time_total=0.0),
        SimpleNamespace(key="Memset", device_time_total=100.0, cpu_time_total=0.0),
        SimpleNamespace(key="host_only", device_time_total=0.0, cpu_time_total=10.0),
    ]
    out = _bench().kernel_times(events, steps=2, top=2)
    assert out["gpu_ms_per_step"] == 0.5  # (600 + 300 + 100) us over 2 steps
    assert [k["name"] for k in out["kernels"]] == ["gemm_kernel", "moe_scatter"]
    assert out["kernels"][0] == {"name": "gemm_kernel", "ms_per_step": 0.3, "share": 0.6}


def test_without_a_cuda_device_it_says_so_and_exits() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/decode_step.py", "--shape", "qwen3-moe-1b"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": ""},
    )
    assert proc.returncode == 1 and "needs a CUDA device" in proc.stderr, proc.stderr[-2000:]


def test_the_benches_named_shapes_build_their_configs() -> None:
    """The shapes the GPU benches name (``shape_config``): the family and size each name stands for."""
    from agentrl.models.tiny import shape_config

    moe = shape_config("qwen3-moe-1b")
    assert type(moe).__name__ == "Qwen3MoeConfig" and (moe.num_experts, moe.num_experts_per_tok) == (16, 2)
    small, large = shape_config("qwen2.5-0.5b"), shape_config("qwen2.5-7b")
    assert type(small).__name__ == type(large).__name__ == "Qwen2Config"
    assert (small.hidden_size, large.hidden_size) == (896, 3584)
    assert small.tie_word_embeddings and not large.tie_word_embeddings
    assert (moe.eos_token_id, moe.pad_token_id) == (
        2,
        0,
    )  # the tiny tokenizer's, whose files the benches copy
    with pytest.raises(ValueError, match=r"choose qwen2\.5-0\.5b"):
        shape_config("qwen2.5-1b")
