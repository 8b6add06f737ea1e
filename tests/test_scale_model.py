"""bench/scale_parts.py, scale_steps.py and scale_points.py: the scale model's arithmetic on cases worked
by hand, and its check against the measured 1-, 2- and 4-GPU points staying within what it states (15 %,
or a stated reason)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "scale_model.py"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve a module's annotations through it, and the points import the model by name
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sm = _load("scale_parts")
steps = _load("scale_steps")
points = _load("scale_points")
INP = sm.ScaleInputs()


def test_shapes_have_the_published_sizes() -> None:
    # bench/lora.py's 7B count, Qwen3's model cards: 30.5B (3.3B active), 235B (22B active)
    assert sm.SHAPES["qwen2.5-7b"].params == pytest.approx(7_615.6e6, rel=1e-4)
    assert sm.SHAPES["smollm2-135m"].params == pytest.approx(134.5e6, rel=1e-3)
    assert sm.SHAPES["qwen3-30b-a3b"].params == pytest.approx(30.5e9, rel=0.01)
    assert sm.SHAPES["qwen3-235b-a22b"].params == pytest.approx(235e9, rel=0.01)
    # active matmul parameters leave out the input embedding: 3.3B - 0.31B, 22B - 0.62B
    assert sm.SHAPES["qwen3-30b-a3b"].active_matmul_params == pytest.approx(3.03e9, rel=0.01)
    assert sm.SHAPES["qwen3-235b-a22b"].active_matmul_params == pytest.approx(21.5e9, rel=0.01)
    # Qwen2.5's model cards: 1.54B and 3.09B
    assert sm.SHAPES["qwen2.5-1.5b"].params == pytest.approx(1.54e9, rel=0.005)
    assert sm.SHAPES["qwen2.5-3b"].params == pytest.approx(3.09e9, rel=0.005)
    # HF tensors: SmolLM2's checkpoint has 272; a Qwen3-MoE layer has 128 x 3 expert tensors
    assert sm.SHAPES["smollm2-135m"].hf_tensors == 272
    assert sm.SHAPES["qwen2.5-7b"].hf_tensors == 339
    assert sm.SHAPES["qwen3-30b-a3b"].hf_tensors == 48 * (4 + 2 + 3 * 128 + 1 + 2) + 3


def test_the_models_shapes_are_the_random_models_the_runs_build() -> None:
    """Each shape the scale recipe builds and the model also names has the model's parameter count and
    the norms' weights, which the model leaves out (two a layer, the final one, Qwen3's q/k norms)."""
    import torch
    import transformers

    from agentrl.models.tiny import FULL_SHAPES, shape_config

    shared = sorted(set(FULL_SHAPES) & set(sm.SHAPES))
    assert {"qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen3-30b-a3b"} <= set(shared)
    for name in shared:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(shape_config(name))
        shape = sm.SHAPES[name]
        norms = (2 * shape.layers + 1) * shape.hidden + (
            2 * shape.head_dim * shape.layers if shape.qk_norm else 0
        )
        assert sum(p.numel() for p in model.parameters()) == shape.params + norms, name


def test_decode_step_is_the_larger_of_reads_and_matmuls_and_host_costs() -> None:
    shape = sm.SHAPES["qwen2.5-7b"]
    rows, context = 64, 1000
    read = 2 * shape.params + rows * context * 28 * 2 * 4 * 128 * 2
    memory = read / (4.8e12 * 0.7)
    compute = rows * 2 * shape.active_matmul_params / (989e12 * 0.3)
    assert memory > compute  # 64 rows of a 7B model are bound by HBM
    # the embedded engine: host costs after the device's part
    expected = 1.36e-3 + rows * 28e-6 + memory
    assert sm.decode_step_s(shape, rows, context, 1, INP, "embedded") == pytest.approx(expected)
    # a second GPU halves the reads and the matmuls, not the host costs
    two = sm.decode_step_s(shape, rows, context, 2, INP, "embedded")
    assert two == pytest.approx(1.36e-3 + rows * 28e-6 + memory / 2)
    # SGLang: its host costs overlap the device's part; at 7B the device's is the longer: its reads at
    # its own share of HBM bandwidth, and a quarter of the matmuls not hidden under them
    host = 3.2e-3 + rows * 22.4e-6
    sglang_memory = read / (4.8e12 * 0.657)
    assert host < sglang_memory and compute < sglang_memory
    expected = sglang_memory + 0.253 * compute
    assert sm.decode_step_s(shape, rows, context, 1, INP) == pytest.approx(expected)
    # past the knee the matmuls are the larger, and a quarter of the reads shows
    many = 512
    reads = (2 * shape.params + many * context * 28 * 2 * 4 * 128 * 2) / (4.8e12 * 0.657)
    matmuls = many * 2 * shape.active_matmul_params / (989e12 * 0.3)
    assert matmuls > reads
    assert sm.decode_step_s(shape, many, context, 1, INP) == pytest.approx(matmuls + 0.253 * reads)
    # on a small model the host's part is the step
    small = sm.SHAPES["qwen2.5-0.5b"]
    assert sm.decode_step_s(small, rows, 64, 1, INP) == pytest.approx(host)
    with pytest.raises(ValueError, match="engine"):
        sm.decode_step_s(shape, rows, context, 1, INP, "vllm")


def test_moe_decode_reads_only_the_experts_its_rows_reach() -> None:
    shape = sm.SHAPES["qwen3-30b-a3b"]
    one_row = shape.weight_bytes_touched(1)
    expert = 3 * 2048 * 768 * 2
    dense = 2 * shape.params - 48 * 128 * expert
    assert one_row == pytest.approx(dense + 48 * 8 * expert)
    assert shape.weight_bytes_touched(4096) == pytest.approx(2 * shape.params, rel=1e-6)


def test_training_is_six_flops_a_parameter_a_token_over_mfu_and_peak() -> None:
    shape = sm.SHAPES["qwen2.5-7b"]
    tokens, seq = 1_000_000, 1536
    flops = 6 * shape.active_matmul_params + 6 * 28 * 28 * 128 * seq
    parts = sm.train_s(shape, tokens, 8, seq, INP)
    # 3,584 wide: the 7B shape's MFU; the 0.5B shape (896 wide) takes its own
    assert parts["compute"] == pytest.approx(tokens * flops / (8 * 0.487 * 989e12 * 0.9))
    assert sm.dense_mfu(sm.SHAPES["qwen2.5-0.5b"], INP) == 0.385
    assert sm.dense_mfu(sm.SHAPES["smollm2-135m"], INP) == 0.385
    # 7B fits a rank unsplit: data parallel over 8, fp32 gradients and bf16 weights over NVLink
    assert sm.model_parallel(shape, 8, INP) == 1
    assert parts["collectives"] == pytest.approx(6 * shape.params * 7 / 8 / 319e9)
    assert parts["all_to_all"] == 0
    # across hosts the same collective goes at a NIC's 40 GB/s
    assert sm.train_s(shape, tokens, 16, seq, INP)["collectives"] == pytest.approx(
        6 * shape.params * 15 / 16 / 40e9
    )


def test_sync_is_bytes_over_bandwidth_plus_fixed_and_per_tensor_costs() -> None:
    shape = sm.SHAPES["qwen2.5-7b"]
    # the bench's NCCL push to its own receiver: a broadcast for each of the 339 tensors, and 15.2 GB at
    # the measured broadcast bandwidth
    push = sm.sync_s(shape, "bench", INP, gbytes=15.2, engine="embedded")
    assert push == pytest.approx(339 * 60.8e-6 + 15.2e9 / 367e9)
    per_tensor = 339 * 95e-6  # the trainer's side: naming and gathering each tensor
    to_embedded = sm.sync_s(shape, "network", INP, engine="embedded")
    assert to_embedded == pytest.approx(339 * 60.8e-6 + per_tensor + 2 * shape.params / 40e9)
    # SGLang's receiving side adds a fixed cost and one a GB, in a push and in a whole sync alike
    receive = 2.57e-3 + 2 * shape.params / 1e9 * 4.18e-3
    between_hosts = sm.sync_s(shape, "network", INP)
    assert between_hosts == pytest.approx(to_embedded + receive)
    assert sm.sync_s(shape, "bench", INP, gbytes=15.2, engine="sglang") == pytest.approx(
        push + 2.57e-3 + 15.2 * 4.18e-3
    )
    # and for a mixture of experts one an expert tensor: 12 layers of 128 experts, 3 tensors each
    moe = steps.MOE_12
    assert moe.hf_tensors == 4719
    extra = sm.sync_s(moe, "bench", INP, gbytes=16.2) - sm.sync_s(
        moe, "bench", INP, gbytes=16.2, engine="embedded"
    )
    assert extra == pytest.approx(2.57e-3 + 16.2 * 4.18e-3 + 12 * 128 * 3 * 111e-6)
    embedded = sm.sync_s(shape, "ipc", INP, engine="embedded")
    assert embedded == pytest.approx(0.0207 + per_tensor + 6 * 2 * shape.params / 4.8e12)
    # SGLang packs and loads tensor by tensor at its own costs, an expert's tensor at a higher one
    colocated = sm.sync_s(shape, "ipc", INP)
    assert colocated == pytest.approx(0.0207 + 2 * shape.params / 1e9 * 8.08e-3 + 339 * 124.2e-6)
    moe_ipc = sm.sync_s(moe, "ipc", INP, gbytes=16.2)
    assert moe_ipc == pytest.approx(0.0207 + 16.2 * 8.08e-3 + 111 * 124.2e-6 + 4608 * 330.1e-6)
    # a trainer copy split over two GPUs first assembles the half each engine lacks
    split = sm.sync_s(shape, "ipc", INP, trainer_split=2)
    assert split == pytest.approx(colocated + shape.params / 1e9 * 27.85e-3)
    assert colocated < 1.0 and between_hosts < 2.0  # the 7B sync targets, as the model sees them
    with pytest.raises(ValueError, match="engine"):
        sm.sync_s(shape, "ipc", INP, engine="vllm")


def test_placements_compose_the_parts() -> None:
    shape, w = sm.SHAPES["qwen2.5-7b"], sm.Workload()
    colocated = sm.predict(shape, 1, "colocated", w, INP)
    assert colocated["step_s"] == pytest.approx(sum(colocated["parts_s"].values()), abs=0.02)
    serial = sm.predict(shape, 1, "disaggregated", w, INP)
    overlapped = sm.predict(shape, 1, "async", w, INP)
    parts = overlapped["parts_s"]
    assert overlapped["step_s"] == pytest.approx(
        max(parts["rollout"], parts["train"]) + parts["sync"], abs=0.02
    )
    assert overlapped["step_s"] < serial["step_s"]
    assert overlapped["bottleneck"] in ("rollout", "train", "sync")
    # weak scaling: the same batch a GPU, so only the collectives and the sync change with the hosts
    assert sm.predict(shape, 4, "colocated", w, INP)["parts_s"]["rollout"] == colocated["parts_s"]["rollout"]


def test_the_trainer_offload_hides_behind_the_generation_unless_serial() -> None:
    shape = sm.SHAPES["qwen2.5-7b"]
    kv = sm.handover_s(shape, 1, 1, 20.0, INP, offload="none")
    weights = 2 * 2 * shape.params / 33e9  # the engine's weights saved and restored
    assert kv == pytest.approx(0.0157 + 0.66e-3 * 20 + 0.0024 + 0.457e-3 * 20 + weights)
    # one GPU, nothing to shard over: bf16 weights, fp32 gradients and the whole optimizer state
    moves = 2 * (2 + 4 + 12) * shape.params / 33e9
    assert sm.handover_s(shape, 1, 1, 20.0, INP, offload="serial") == pytest.approx(kv + moves)
    assert sm.handover_s(shape, 1, 1, 20.0, INP, hidden=moves + 1) == pytest.approx(kv)
    assert sm.handover_s(shape, 1, 1, 20.0, INP, hidden=moves - 1) == pytest.approx(kv + 1)
    with pytest.raises(ValueError, match="offload"):
        sm.handover_s(shape, 1, 1, 20.0, INP, offload="later")


def test_the_235b_trainer_state_needs_eight_hosts() -> None:
    shape, w = sm.SHAPES["qwen3-235b-a22b"], sm.Workload()
    assert not sm.predict(shape, 4, "colocated", w, INP)["fits"]
    assert sm.predict(shape, 8, "colocated", w, INP)["fits"]
    assert sm.engine_gpus_for(shape, INP) == 8


def test_measured_points_stay_within_the_stated_error() -> None:
    rows = points.check_points(INP)
    assert len(rows) == len(points.POINTS) >= 30
    assert {r["gpus"] for r in rows} == {1, 2, 4}
    for row in rows:
        if row["role"] == "fit":
            assert abs(row["error"]) <= 0.10, row
        elif not row["within"]:
            assert row["why"] != "not explained", row  # every miss says why
    checked = [r for r in rows if r["role"] == "check"]
    assert sum(r["within"] for r in checked) >= 40  # of 55; the doc lists the 15 that miss
    # a stated reason only where the point misses: one that comes within the bound loses it
    for point, row in zip(points.POINTS, rows, strict=True):
        assert bool(point.why) == (not row["within"]), point.what


def test_every_input_names_its_kind_and_source() -> None:
    for row in INP.table():
        assert row["kind"] in ("measured", "fit", "vendor", "assumption"), row
        assert row["source"], row
        if row["kind"] in ("measured", "fit"):  # the commit and the GPU kind it was measured on
            assert re.search(r"\b[0-9a-f]{7}\b", row["source"]) and re.search(r"H[12]00", row["source"]), row
    # what NCCL and the host copies reached stays under the vendor's line rates
    assert INP.nvlink_broadcast <= INP.nvlink_bytes_per_s
    assert INP.host_copy_bytes_per_s <= INP.pcie_bytes_per_s


def test_the_bench_prints_predictions_checks_and_a_summary() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--hosts", "1,2", "--shapes", "qwen2.5-7b"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    kinds = [line["kind"] for line in lines]
    assert kinds.count("prediction") == 2 * 3
    assert kinds.count("check") == len(points.POINTS)
    assert lines[-1]["kind"] == "summary" and lines[-1]["checked"] == 64


def test_the_bench_prints_the_inputs_with_their_kinds() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--inputs", "--hosts", "1", "--shapes", "qwen2.5-7b"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    inputs = [line for line in map(json.loads, proc.stdout.splitlines()) if line["kind"] == "input"]
    assert [line["name"] for line in inputs] == [row["name"] for row in INP.table()]
    by_name = {line["name"]: line for line in inputs}
    assert by_name["peak_flops"]["input_kind"] == "vendor"
    assert by_name["sglang_exposed"]["input_kind"] == "fit" and by_name["sglang_exposed"]["value"] == 0.253
