"""The batch-invariant matmul's tiling on a GPU: speed against cuBLAS, and whether a row's bits stay put.

``agentrl.batch_invariant`` runs every matmul of the engine's batch-invariant mode and of the true
on-policy trainer through one Triton kernel with one tiling for every shape (its module constant
``_BM, _BN, _BK, _WARPS, _STAGES``). This bench times that kernel for each tiling in ``--tilings`` on the
projections of a model shape at ``--rows`` rows (the trainer's micro-batch tokens; the LM head
included), against ``a @ w.T`` by cuBLAS in the same run, and checks batch invariance: the first ``m``
rows computed alone equal the same rows of the full product, bit for bit, for ``m`` in 1..255 and a few
larger counts. It also times each tiling at an engine's decode row counts (``--decode-rows``: one row
per sequence in flight), where the narrow projections give a large tile few programs, and compares
each tiling's bits with the first one's (a tiling may vary with the weight's shape, never with the row
count; whether two tilings agree bit for bit says how free that choice is). Prints ONE JSON line: per
tiling, TFLOP/s per shape, the harmonic mean over the shapes (weighted by their FLOPs) against
cuBLAS's, the row counts whose bits moved (none is required), microseconds per shape at each decode row
count (cuBLAS's beside them) and the shapes whose bits differ from the first tiling's.

    python bench/batch_invariant_matmul.py [--shape qwen2.5-0.5b] [--rows 4096] [--decode-rows 64,256]
        [--tilings 64,64,64,4,3 128,128,64,8,3 128,128,64,4,4 128,256,64,8,3]
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


def matmul_with(tiling: tuple[int, int, int, int, int]):
    """``a @ w.T`` by the batch-invariant kernel with ``tiling`` (BM, BN, BK, warps, stages)."""
    import triton

    from agentrl.batch_invariant.triton_ops import _mm_kernel

    bm, bn, bk, warps, stages = tiling

    def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = a.shape
        c = torch.empty(m, w.shape[0], dtype=a.dtype, device=a.device)
        grid = (triton.cdiv(m, bm), triton.cdiv(w.shape[0], bn))
        _mm_kernel[grid](a, w, c, m, w.shape[0], k, a.stride(0), w.stride(0), c.stride(0), BM=bm, BN=bn, BK=bk,
                         IEEE=a.dtype == torch.float32, num_warps=warps, num_stages=stages)  # fmt: skip
        return c

    return mm


def seconds(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=4096, help="rows of the product (a micro-batch's tokens)")
    ap.add_argument("--tilings", nargs="+", default=["64,64,64,4,3", "128,128,64,8,3", "128,128,64,4,4",
                                                     "128,256,64,8,3"])  # fmt: skip
    ap.add_argument("--decode-rows", default="64,256", help="row counts of decode steps to time (comma-separated)")
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this bench needs a CUDA device (the kernel is Triton's)")
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = [*range(1, 256), 1000, a.rows - 1]
    operands = []
    for k, n in SHAPES[a.shape]:
        x = torch.randn(a.rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
        operands.append((k, n, x, w))
    flops = [2 * a.rows * k * n for k, n, _, _ in operands]
    cublas = [seconds(lambda x=x, w=w: x @ w.T, a.repeats) for _, _, x, w in operands]
    decode_rows = [int(m) for m in a.decode_rows.split(",") if m]

    def decode_us(mm) -> dict[str, list[float]]:
        return {
            str(m): [round(seconds(lambda x=x, w=w, m=m: mm(x[:m], w), a.repeats) * 1e6, 1) for _, _, x, w in operands]
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
        "tilings": {},
    }
    first: list[torch.Tensor] = []  # the first tiling's products, one per shape
    for spec in a.tilings:
        tiling = tuple(int(v) for v in spec.split(","))
        mm = matmul_with(tiling)  # type: ignore[arg-type]
        times, moved, differ = [], [], []
        for i, (k, n, x, w) in enumerate(operands):
            times.append(seconds(lambda x=x, w=w, mm=mm: mm(x, w), a.repeats))
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
