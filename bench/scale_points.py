"""The scale model's check (:mod:`scale_parts`): every figure measured on 1, 2 and 4 GPUs that the model can
predict, with its source (commit, GPU kind, results page), how the model predicts it from its parts,
whether an input was fit to it, and, where it misses 15%, why. The benches of parts (engines, trainers,
pushes, hand-overs) are here, the whole 7B and MoE steps in :mod:`scale_steps`. ``python
bench/scale_model.py`` prints the check beside the predictions; docs/design/scale-model.md tabulates it."""

from __future__ import annotations

import dataclasses
from typing import Any

from scale_parts import (
    SHAPES,
    ScaleInputs,
    Shape,
    decode_step_s,
    engine_tokens_per_s,
    prefill_s,
    sync_s,
    trainer_state_bytes,
)
from scale_steps import MOE_12, STEP_POINTS, Point

H100 = {"hbm_bytes_per_s": 3.35e12}  # NVIDIA H100 SXM datasheet: HBM3 3.35 TB/s; the same compute


def _engine_point(engine: str, shape: str, rows: int, gpu: dict[str, float] | None = None) -> Any:
    def predict(inp: ScaleInputs) -> float:
        # the bench's rows: a 32-token prompt and, on average, half of their 64 new tokens
        inp = dataclasses.replace(inp, **(gpu or {}))
        return engine_tokens_per_s(SHAPES[shape], rows, 64, 1, inp, engine)

    return predict


def _engine_round_7b(inp: ScaleInputs) -> float:
    """bench/engine_throughput.py's round on the 7B shape: 256 requests with 128 in flight, prompts of 512
    tokens, 1,024 new tokens each: the prompts prefilled, then two waves of 1,024 decode steps."""
    shape = SHAPES["qwen2.5-7b"]
    rows, prompt, new = 128, 512, 1024
    decode = 2 * new * decode_step_s(shape, rows, prompt + new / 2, 1, inp)
    return 2 * rows * new / (prefill_s(shape, 2 * rows, prompt, 1, inp) + decode)


def _trainer_dp2(inp: ScaleInputs) -> float:
    """DP2 tokens/s of the 0.5B shape from its one-GPU rate in the same run (39,269)."""
    shape, tokens = SHAPES["qwen2.5-0.5b"], 32 * 1023
    collectives = (inp.grad_bytes + 2) * shape.params / 2 / inp.nvlink_allreduce_bus
    return tokens / (tokens / 39_269 / 2 + collectives)


def _trainer_tp2(inp: ScaleInputs) -> float:
    """TP2 tokens/s from the one-GPU rate in the same run (46,906): half the matmuls a GPU, and two
    all-reduces of the activations a layer forward and two backward."""
    shape, tokens = SHAPES["qwen2.5-0.5b"], 32 * 1023
    all_reduce = 4 * shape.layers * tokens * shape.hidden * 2 / inp.nvlink_allreduce_bus
    return tokens / (tokens / 46_906 / 2 + all_reduce)


def _offload(gpus: int) -> Any:
    def predict(inp: ScaleInputs) -> float:
        return trainer_state_bytes(SHAPES["smollm2-135m"], gpus, inp) / inp.host_copy_bytes_per_s

    return predict


def _weak_scaling(one_gpu_step: float, gpus: int) -> Any:
    """A colocated DP run from the one-GPU run of the same call, at the same batch a GPU: each GPU
    generates, trains, syncs and hands over what the one GPU did; the gradients cross NVLink."""

    def predict(inp: ScaleInputs) -> float:
        shape = SHAPES["smollm2-135m"]
        dp_bytes = (inp.grad_bytes + 2) * shape.params * (gpus - 1) / gpus
        return one_gpu_step + dp_bytes / inp.nvlink_allreduce_bus

    return predict


def _disaggregated_1_1(inp: ScaleInputs) -> float:
    """1 engine GPU + 1 trainer GPU, one step off-policy, from the colocated run of the same call
    (wait 0.427 s = the engine's time for a batch, train 0.482 s)."""
    sync = sync_s(SHAPES["smollm2-135m"], "nvlink", inp, engine="embedded")
    return max(0.427, 0.482 + sync) + inp.pause_s


_MOE_ENGINE = (
    "the embedded engine's MoE round: about 70% of it outside the decode forward (eager MoE prefill, "
    "routing bookkeeping; sglang.md), which the read model does not have; the two runs of this bench "
    "gave 25,899 and 16,882 tok/s at 256; SGLang's fused MoE kernel is within the bound at 64 and 256"
)
_H100_SPREAD = (
    "the same bench on the same GPU kind spread 9,842-19,410 tok/s at 64 in flight and 24,239-43,584 "
    "at 256 between runs and hosts (engine-throughput.md: part of it the host); the row cost is fit on "
    "H200 runs of later commits"
)
_H200_ENGINE = [
    ("qwen2.5-0.5b", 64, 19_315, "b8a69bd, 1x H200, fp8-rollout.md"),
    ("qwen2.5-0.5b", 256, 30_303, "b8a69bd, 1x H200, fp8-rollout.md"),
    ("qwen2.5-7b", 64, 8_174, "30f3000, 1x H200, fp8-rollout.md"),
    ("qwen2.5-7b", 256, 11_314, "30f3000, 1x H200, fp8-rollout.md"),
]
_OTHER_ENGINE = [
    ("embedded engine", "qwen3-moe-1b", 64, 9_130, "b8a69bd, 1x H200, fp8-rollout.md", _MOE_ENGINE),
    ("embedded engine", "qwen3-moe-1b", 256, 25_899, "b8a69bd, 1x H200, fp8-rollout.md", ""),
    ("embedded engine", "qwen3-moe-1b", 64, 9_809, "30f3000, 1x H200, sglang.md", _MOE_ENGINE),
    ("embedded engine", "qwen3-moe-1b", 256, 16_882, "30f3000, 1x H200, sglang.md", _MOE_ENGINE),
    ("SGLang", "qwen3-moe-1b", 64, 15_222, "30f3000, 1x H200, sglang.md", ""),
    ("SGLang", "qwen3-moe-1b", 256, 30_045, "30f3000, 1x H200, sglang.md", ""),
    ("embedded engine", "qwen2.5-0.5b", 64, 19_410, "185b92d, 1x H100, sglang.md", ""),
    ("embedded engine", "qwen2.5-0.5b", 256, 43_584, "185b92d, 1x H100, sglang.md", _H100_SPREAD),
    ("SGLang", "qwen2.5-0.5b", 64, 12_647, "185b92d, 1x H100, sglang.md", ""),
    ("SGLang", "qwen2.5-0.5b", 256, 27_337, "185b92d, 1x H100, sglang.md", ""),
    ("embedded engine", "qwen2.5-0.5b", 64, 9_842, "6e95082, 1x H100, engine-throughput.md", _H100_SPREAD),
    ("embedded engine", "qwen2.5-0.5b", 256, 24_239, "6e95082, 1x H100, engine-throughput.md", ""),
]
_MULTI = "multi-gpu.md"


def _sync(
    shape: str | Shape,
    transport: str,
    gbytes: float | None = None,
    gpu: dict[str, float] | None = None,
    engine: str = "embedded",
) -> Any:
    """A sync into ``engine`` (the embedded engine, or the bench's receiver of its broadcasts)."""
    model = SHAPES[shape] if isinstance(shape, str) else shape
    return lambda inp: sync_s(
        model, transport, dataclasses.replace(inp, **(gpu or {})), gbytes=gbytes, engine=engine
    )


_SWEEP = "c436473, 1x H200 of a 2x host, sglang.md"
# SGLang on the 7B shape, --split: a decode step (ms) and the prefill of 2C prompts of 512 tokens (s)
_SGLANG_7B_SWEEP = [
    (16, 5.319, 0.3642),
    (32, 5.802, 0.7290),
    (64, 6.828, 1.4436),
    (128, 9.221, 2.8971),
    (192, 11.244, 4.3474),
    (256, 14.629, 5.8195),
]


def _sglang_7b_decode(rows: int) -> Any:
    """A decode step of the sweep: its rows at 1,024 tokens of context on average."""
    return lambda inp: decode_step_s(SHAPES["qwen2.5-7b"], rows, 512 + 1024 / 2, 1, inp)


def _sglang_7b_prefill(rows: int) -> Any:
    return lambda inp: prefill_s(SHAPES["qwen2.5-7b"], 2 * rows, 512, 1, inp)


POINTS: list[Point] = [
    *[
        Point(
            f"embedded engine tok/s, {s}, {c} in flight",
            1,
            v,
            "tok/s",
            src,
            _engine_point("embedded", s, c),
            "fit",
        )
        for s, c, v, src in _H200_ENGINE
    ],
    *[
        Point(
            f"{e} tok/s, {s}, {c} in flight",
            1,
            v,
            "tok/s",
            src,
            _engine_point("sglang" if e == "SGLang" else "embedded", s, c, None if "H200" in src else H100),
            "fit" if e == "SGLang" else "check",
            why=why,
        )
        for e, s, c, v, src, why in _OTHER_ENGINE
    ],
    Point(
        "SGLang tok/s, 7B shape, 128 in flight, prompts of 512 tokens, 1,024 new (256 requests)",
        1,
        12_416,
        "tok/s",
        "77827b0, 1x H200 of a 2x host, sglang.md",
        _engine_round_7b,
    ),
    *[
        Point(
            f"SGLang decode step, 7B shape, {rows} rows of 1,024 tokens on average",
            1,
            ms / 1e3,
            "s",
            _SWEEP,
            _sglang_7b_decode(rows),
            "fit" if rows in (16, 256) else "check",
        )
        for rows, ms, _ in _SGLANG_7B_SWEEP
    ],
    *[
        Point(
            f"SGLang prefill, 7B shape, {2 * rows} prompts of 512 tokens, {rows} at a time",
            1,
            seconds,
            "s",
            _SWEEP,
            _sglang_7b_prefill(rows),
            "fit" if rows in (16, 256) else "check",
        )
        for rows, _, seconds in _SGLANG_7B_SWEEP
    ],
    Point("trainer DP2 tok/s, 0.5B shape", 2, 71_356, "tok/s", f"e3f220d, 2x H200, {_MULTI}", _trainer_dp2),
    Point(
        "trainer TP2 tok/s, 0.5B shape",
        2,
        37_478,
        "tok/s",
        f"e3f220d, 2x H200, {_MULTI}",
        _trainer_tp2,
        why="the model keeps the one-GPU MFU under tensor parallelism; the 0.5B shape's half-width "
        "matmuls (896 wide) run far below it. The predictions use no tensor parallelism in the trainer",
    ),
    Point(
        "NCCL push, 0.5B shape (0.99 GB)",
        2,
        0.020,
        "s",
        f"e3f220d, 2x H200, {_MULTI}",
        _sync("qwen2.5-0.5b", "bench", 0.99),
        "check",
    ),
    Point(
        "NCCL push, 7B shape (15.2 GB)",
        2,
        0.059,
        "s",
        f"e3f220d, 2x H200, {_MULTI}",
        _sync("qwen2.5-7b", "bench", 15.2),
    ),
    *[
        Point(
            f"NCCL push, {name} ({gb} GB), under SGLang's NCCL setting, {what}",
            2,
            seconds,
            "s",
            "c436473, 2x H200, sglang.md",
            _sync(shape, "bench", gb, engine=engine),
            role,
        )
        for name, shape, gb, what, engine, seconds, role in [
            ("0.5B shape", "qwen2.5-0.5b", 0.99, "the bench's receiver", "embedded", 0.0200, "fit"),
            ("7B shape", "qwen2.5-7b", 15.2, "the bench's receiver", "embedded", 0.0641, "fit"),
            ("12 of 30B-A3B's layers", MOE_12, 16.2, "the bench's receiver", "embedded", 0.3321, "fit"),
            ("0.5B shape", "qwen2.5-0.5b", 0.99, "an SGLang server", "sglang", 0.0267, "fit"),
            ("7B shape", "qwen2.5-7b", 15.2, "an SGLang server", "sglang", 0.1303, "fit"),
            ("12 of 30B-A3B's layers", MOE_12, 16.2, "an SGLang server", "sglang", 0.9137, "fit"),
        ]
    ],
    Point(
        "in-memory sync, SmolLM2",
        1,
        0.047,
        "s",
        "e8793d1, 1x H100, colocation.md",
        _sync("smollm2-135m", "ipc", gpu=H100),
        "fit",
    ),
    Point(
        "in-memory sync, 0.5B shape",
        1,
        0.050,
        "s",
        "1d1fbc2, 1x H100, colocation.md",
        _sync("qwen2.5-0.5b", "ipc", gpu=H100),
        "fit",
    ),
    Point(
        "in-memory sync in a Search-R1 step, 1 GPU",
        1,
        0.052,
        "s",
        f"e3f220d, 2x H200 host, {_MULTI}",
        _sync("smollm2-135m", "ipc"),
    ),
    Point(
        "in-memory sync in a Search-R1 step, DP2 (each GPU)",
        2,
        0.060,
        "s",
        f"e3f220d, 2x H200, {_MULTI}",
        _sync("smollm2-135m", "ipc"),
        why="two engine-trainer pairs syncing at once took 0.060 s against 0.052 s alone; the model has "
        "no contention between the pairs of a host (the same run's release and resume grew too)",
    ),
    Point(
        "NCCL sync in a Search-R1 step, disaggregated 1+1, embedded",
        2,
        0.046,
        "s",
        f"e3f220d, 2x H200, {_MULTI}",
        _sync("smollm2-135m", "nvlink"),
    ),
    Point(
        "NCCL sync in a Search-R1 step, disaggregated 1+1, SGLang",
        2,
        0.055,
        "s",
        "a269f59, 2 GPUs of 4x H200, sglang.md",
        _sync("smollm2-135m", "nvlink", engine="sglang"),
    ),
    Point(
        "trainer offload, SmolLM2, 1 GPU, KV pool 0.2",
        1,
        0.073,
        "s",
        f"a269f59, 4x H200 host, {_MULTI}",
        _offload(1),
        "fit",
    ),
    Point(
        "trainer offload, SmolLM2, 1 GPU, KV pool 0.7",
        1,
        0.070,
        "s",
        f"a269f59, 4x H200 host, {_MULTI}",
        _offload(1),
    ),
    Point(
        "trainer offload, SmolLM2, DP2 (each rank), KV pool 0.2",
        2,
        0.046,
        "s",
        f"a269f59, 4x H200 host, {_MULTI}",
        _offload(2),
    ),
    Point(
        "trainer offload, SmolLM2, DP2 (each rank), KV pool 0.7",
        2,
        0.112,
        "s",
        f"a269f59, 4x H200 host, {_MULTI}",
        _offload(2),
        why="with a 91 GB KV pool on each of two GPUs, release, KV resume and offload all took 2-3x their "
        "one-GPU time (multi-gpu.md); with the 0.2 pool the same offload is within 6%",
    ),
    Point(
        "Search-R1 step, colocated DP2, one rollout shard (1 GPU: 1.305 s)",
        2,
        1.562,
        "s",
        f"e3f220d, 2x H200, {_MULTI}",
        _weak_scaling(1.305, 2),
        why="one rollout event loop and one retrieval server fed both engines (multi-gpu.md): the wait "
        "grew 0.43 -> 0.58 s; the model assumes a rollout shard per engine, which later runs have",
    ),
    Point(
        "Search-R1 step, colocated DP2, 2 shards (1 GPU: 1.556 s)",
        2,
        1.738,
        "s",
        f"30f3000, 4x H200 host, {_MULTI}",
        _weak_scaling(1.556, 2),
    ),
    Point(
        "Search-R1 step, colocated DP2, KV pool 0.7 (1 GPU: 1.586 s)",
        2,
        1.639,
        "s",
        f"a269f59, 4x H200 host, {_MULTI}",
        _weak_scaling(1.586, 2),
    ),
    Point(
        "Search-R1 step, colocated DP2, KV pool 0.2 (1 GPU: 1.423 s)",
        2,
        1.406,
        "s",
        f"a269f59, 4x H200 host, {_MULTI}",
        _weak_scaling(1.423, 2),
    ),
    Point(
        "Search-R1 step, colocated DP4, 4 shards, KV pool 0.2 (1 GPU: 1.330 s)",
        4,
        1.667,
        "s",
        "ae2ef79, 4x H200, multi-gpu.md",
        _weak_scaling(1.330, 4),
        why="the record gives the DP4 wait (0.42 s) and sync (0.28 s) but no breakdown of the one-GPU "
        "run of the same call; the 0.34 s the model lacks is the hand-overs of four pairs at once and "
        "time not broken down. Not explained by the model",
    ),
    Point(
        "Search-R1 step, disaggregated 1+1, async (colocated 1 GPU: wait 0.427, train 0.482 s)",
        2,
        0.612,
        "s",
        f"e3f220d, 2x H200, {_MULTI}",
        _disaggregated_1_1,
    ),
    *STEP_POINTS,
]


def check_points(inp: ScaleInputs, bound: float = 0.15) -> list[dict[str, Any]]:
    """Every measured point beside the model's value, with the relative error."""
    rows = []
    for point in POINTS:
        predicted = point.predict(inp)
        error = predicted / point.measured - 1
        row = {k: v for k, v in dataclasses.asdict(point).items() if k not in ("predict", "why")}
        row.update(predicted=round(predicted, 4), error=round(error, 3), within=abs(error) <= bound)
        if not row["within"]:
            row["why"] = point.why or "not explained"
        rows.append(row)
    return rows
