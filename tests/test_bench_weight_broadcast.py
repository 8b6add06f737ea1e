"""bench/weight_broadcast.py on the CPU (gloo, tiny shape): agentrl's broadcast sender pushes to a receiver
process in buckets, every byte arrives, and the JSON line carries the figures the GPU run reports."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "weight_broadcast.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("weight_broadcast", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flatten", [False, True])
def test_bench_broadcasts_every_byte_in_buckets_and_reports_bandwidths(flatten: bool) -> None:
    args = ["--device", "cpu", "--bucket-mb", "0.1", "--repeats", "2", "--collective-mb", "1", "--iters", "2"]
    args += ["--flatten"] if flatten else []
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # one JSON line
    out = json.loads(lines[0])
    assert out["bench"] == "weight_broadcast"
    assert (out["backend"], out["device"], out["dtype"], out["bucket_mb"]) == ("gloo", "cpu", "float32", 0.1)

    from agentrl.trainer.arch import ModelArch
    from agentrl.trainer.model import hf_param_shapes

    bench = _bench_module()
    shapes = hf_param_shapes(ModelArch.from_hf_config(bench.shape_config("tiny")))
    [tiny] = out["shapes"]
    assert tiny["shape"] == "tiny"
    assert tiny["tensors"] == len(shapes)
    assert tiny["bytes"] == 4 * sum(math.prod(s) for s in shapes.values())  # float32
    assert tiny["verified"] is True  # the receiver got every byte (checksums equal)
    assert out["receivers"] == ["embedded"] and "sglang" not in tiny  # SGLang's side only when asked
    assert tiny["buckets"] >= tiny["bytes"] // int(0.1 * 2**20)  # 0.1 MB buckets: several
    # a broadcast a tensor, or one a bucket of its bytes
    assert out["flatten"] is flatten
    assert tiny["broadcasts"] == (tiny["buckets"] if flatten else tiny["tensors"])
    assert tiny["seconds_min"] <= tiny["seconds"]
    assert tiny["gbps"] == pytest.approx(tiny["bytes"] / tiny["seconds"] / 1e9)
    for op in ("all_reduce", "broadcast"):
        c = out[op]
        assert c["bytes"] == 1 << 20 and c["iters"] == 2 and c["seconds"] > 0
        assert c["busbw_gbps"] == pytest.approx(c["algbw_gbps"])  # two ranks: 2(n-1)/n = 1
        assert c["algbw_gbps"] == pytest.approx(c["bytes"] / c["seconds"] / 1e9)


def test_bus_bandwidth_is_nccl_tests_formula() -> None:
    bench = _bench_module()
    assert bench.bus_bandwidth("all_reduce", 8 * 10**9, 2.0, ranks=8) == {
        "algbw_gbps": 4.0,
        "busbw_gbps": 7.0,
    }
    assert bench.bus_bandwidth("broadcast", 8 * 10**9, 2.0, ranks=8)["busbw_gbps"] == 4.0


@pytest.mark.parametrize(
    ("receivers", "says"),
    [
        ("sglang", "--receivers: embedded, or embedded,sglang, not 'sglang'"),
        ("embedded,sglang", "SGLang runs on a GPU (--device cuda)"),
    ],
)
def test_an_sglang_receiver_is_refused_where_it_cannot_run(receivers: str, says: str) -> None:
    """SGLang's receiving side is measured beside the bench's own receiver (the baseline), and on a GPU."""
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--receivers", receivers],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]


def test_a_full_size_shape_can_be_cut_to_its_first_layers() -> None:
    """``qwen3-30b-a3b:12``: the MoE shape of the 2-GPU MoE step, 12 of its 48 layers: 4,719 tensors,
    where the 7B shape has 339 for about as many bytes (what tells a cost a tensor from one a byte)."""
    from agentrl.trainer.arch import ModelArch
    from agentrl.trainer.model import hf_param_shapes

    bench = _bench_module()

    def count(name: str) -> tuple[int, int]:
        shapes = hf_param_shapes(ModelArch.from_hf_config(bench.shape_config(name)))
        return len(shapes), 2 * sum(math.prod(s) for s in shapes.values())

    tensors, nbytes = count("qwen3-30b-a3b:12")
    assert tensors == 12 * (4 + 2 + 3 * 128 + 1 + 2) + 3 == 4719
    assert nbytes == pytest.approx(16.2e9, rel=0.01)
    assert count("qwen2.5-7b")[0] == 339
    assert count("qwen3-30b-a3b")[0] == 48 * 393 + 3  # uncut
