"""The batch-invariant matmul's tilings on a GPU: speed against cuBLAS, and whether a row's bits stay put.

``agentrl.batch_invariant`` runs every matmul of the engine's batch-invariant mode and of the true
on-policy trainer through one Triton kernel whose bits do not depend on its tiling, so it picks a tiling
by the row count (``TILINGS`` in :mod:`agentrl.batch_invariant.triton_ops`). This bench times each
tiling in ``--tilings``, and the kernel's own choice (``auto``), on the projections of a model shape at
``--rows`` rows (the trainer's micro-batch tokens; the LM head included) and at the row counts of
``--decode-rows`` (an engine's decode steps: one row per sequence in flight), against ``a @ w.T`` by
cuBLAS in the same run. Times are the kernels' own: each call repeated inside one captured CUDA graph.
It checks batch invariance (the first ``m`` rows computed alone equal the same rows of the full product,
bit for bit, for ``m`` in 1..600 and a few larger counts) and compares each tiling's bits with the first
one's (they must agree for the choice by row count to keep a row's bits). Prints ONE JSON line: per
tiling, TFLOP/s per shape, the harmonic mean over the shapes (weighted by their FLOPs) against
cuBLAS's, the row counts whose bits moved (none is required), microseconds per shape at each decode row
count (cuBLAS's beside them) and the shapes whose bits differ from the first tiling's.

    python bench/batch_invariant_matmul.py [--shape qwen2.5-0.5b] [--rows 4096] [--decode-rows 64,256]
        [--tilings 64,64,64,4,3 128,128,64,8,3 64,32,64,4,3]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = {  # (K, N) of each projection: q, k/v, o, gate/up, down, LM head
    "qwen2.5-0.5b": [(896, 896), (896, 128), (896, 896), (896, 4864), (4864, 896), (896, 151936)],
    "smollm2-135m": [(576, 576), (576, 192), (576, 576), (576, 1536), (1536, 576), (576, 49152)],
}


def matmul_with(tiling: tuple[int, int, int, int, int] | None):
    """``a @ w.T`` by the batch-invariant kernel with ``tiling`` (BM, BN, BK, warps, stages), or with the
    kernel's own choice by row count (None)."""
    from agentrl.batch_invariant.triton_ops import _launch, _mm

    if tiling is None:
        return _mm
    return lambda a, w: _launch(a, w, None, None, tiling)


def seconds(fn, repeats: int) -> float:
    """GPU seconds per call of ``fn(i)``: calls ``i = 0..repeats-1`` captured in one CUDA graph, replayed."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(repeats):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (3 * repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=4096, help="rows of the product (a micro-batch's tokens)")
    ap.add_argument(
        "--tilings", nargs="+", default=["64,64,64,4,3", "128,128,64,8,3", "64,32,64,4,3", "64,128,64,4,4"]
    )
    ap.add_argument(
        "--decode-rows", default="64,256", help="row counts of decode steps to time (comma-separated)"
    )
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this bench needs a CUDA device (the kernel is Triton's)")
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = [*range(1, 601), 1000, a.rows - 1]
    operands = []
    for k, n in SHAPES[a.shape]:
        x = torch.randn(a.rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
        operands.append((k, n, x, w))
    flops = [2 * a.rows * k * n for k, n, _, _ in operands]
    cublas = [seconds(lambda _, x=x, w=w: x @ w.T, a.repeats) for _, _, x, w in operands]
    decode_rows = [int(m) for m in a.decode_rows.split(",") if m]
    # a decode step reads each layer's weights once, from HBM: the decode timings cycle through copies of
    # a weight that together outsize the L2 cache, as a model's layers do
    copies = [[w] + [w.clone() for _ in range(min(31, (256 << 20) // w.nbytes))] for _, _, _, w in operands]

    def decode_us(mm) -> dict[str, list[float]]:
        return {
            str(m): [
                round(seconds(lambda i, x=x, ws=ws, m=m: mm(x[:m], ws[i % len(ws)]), a.repeats) * 1e6, 1)
                for (_, _, x, _), ws in zip(operands, copies, strict=True)
            ]
            for m in decode_rows
        }

    result: dict = {
        "bench": "batch_invariant_matmul",
        "gpu": torch.cuda.get_device_name(),
        "shape": a.shape,
        "rows": a.rows,
        "cublas_tflops": [round(f / s / 1e12, 1) for f, s in zip(flops, cublas, strict=True)],
        "cublas_tflops_overall": round(sum(flops) / sum(cublas) / 1e12, 1),
        "cublas_decode_us": decode_us(lambda x, w: x @ w.T),
        "decode_weights_cycled": [len(ws) for ws in copies],
        "tilings": {},
    }
    first: list[torch.Tensor] = []  # the first tiling's products, one per shape
    for spec in [*a.tilings, "auto"]:
        tiling = None if spec == "auto" else tuple(int(v) for v in spec.split(","))
        mm = matmul_with(tiling)  # type: ignore[arg-type]
        times, moved, differ = [], [], []
        for i, (k, n, x, w) in enumerate(operands):
            times.append(seconds(lambda _, x=x, w=w, mm=mm: mm(x, w), a.repeats))
            full = mm(x, w)
            moved += [f"{k}x{n}@{m}" for m in counts if not torch.equal(mm(x[:m], w), full[:m])]
            if len(first) < len(operands):
                first.append(full)
            elif not torch.equal(full, first[i]):
                differ.append(f"{k}x{n}")
        result["tilings"][spec] = {
            "tflops": [round(f / s / 1e12, 1) for f, s in zip(flops, times, strict=True)],
            "tflops_overall": round(sum(flops) / sum(times) / 1e12, 1),
            "over_cublas": round(sum(cublas) / sum(times), 3),
            "rows_whose_bits_moved": moved[:20],
            "decode_us": decode_us(mm),
            "shapes_whose_bits_differ_from_first_tiling": differ,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
