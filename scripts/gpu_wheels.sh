#!/usr/bin/env bash
# Prepare, on a machine with the package index, what a GPU machine without it needs (Python 3.12, x86-64).
#
#   bash scripts/gpu_wheels.sh            -> .whl/gpu/     (about 45 MB) agentrl's own dependencies
#   bash scripts/gpu_wheels.sh --sglang   -> .whl/sglang/  (about 125 MB, in parts of at most 60 MB)
#
# .whl/gpu: the wheels the image lacks (megatron-core, pydantic, bm25s, gguf, openai, ...) and Ray, packed
# without its Java jars, RLlib and dashboard front-end, which a training run does not use.
# .whl/sglang: a real SGLang server for the image's torch. sglang pins an exact torch: pick the release
# whose pin equals the image's torch (0.5.16 pins torch 2.11.0; SGLANG_VERSION and the kernel pins below
# change together, see docs/guide/gpus-and-scaling.md). Only what serving a dense model with triton
# attention and pytorch sampling imports is packed; sglang-kernel loses its FA3, FlashMLA, InfLLM and
# Blackwell (sm100) libraries and xgrammar its static library, which nothing loads. The bundle is split
# into part1/, part2/, ... of at most 60 MB each, so each part travels on its own.
# Install either on the GPU machine with scripts/gpu_setup.sh. Guide: docs/guide/gpus-and-scaling.md.
set -euo pipefail
cd "$(dirname "$0")/.."
plat=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
fetch() {  # fetch DIR SPEC...: the wheels themselves, without dependencies (the lists below are complete)
    local dir=$1
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d "$dir" "$@"
}

if [ "${1:-}" = "--sglang" ]; then
    SGLANG_VERSION=${SGLANG_VERSION:-0.5.16}
    out=.whl/sglang
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    # Into the SGLang servers' own directory (scripts/gpu_setup.sh): sglang, its kernels and what it imports
    # at start-up. transformers and tokenizers are sglang's pins; the trainer keeps the image's.
    fetch "$tmp/site" "sglang==$SGLANG_VERSION" sglang-kernel==0.4.5 flashinfer-python==0.6.14 \
        xgrammar==0.2.1 apache-tvm-ffi==0.1.11 cuda-tile==1.7.0 transformers==5.12.1 tokenizers==0.22.2 \
        compressed-tensors==0.20.0 loguru==0.7.3 ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 parso==0.8.7 \
        matplotlib-inline==0.2.2 traitlets==5.16.1 pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53 \
        wcwidth==0.9.4 stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure-eval==0.2.4 dill==0.4.1 \
        soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 msgspec==0.22.0 partial-json-parser==0.2.1.1.post7 \
        pyzmq==27.3.0 pybase64==1.5.1 python-multipart==0.0.34 interegular==0.3.3
    # Into the main environment too: the sglang-router (tests/test_router.py runs it in front of embedded
    # engines) and the web stack it shares with the servers.
    fetch "$tmp/main" sglang-router==0.3.2 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
        orjson==3.13.0 setproctitle==1.3.8 opentelemetry-api==1.45.2
    python3 - "$tmp" "$out" <<'EOF'
"""Strip what is never loaded from two wheels, then lay every wheel into parts of at most 60 MB."""
import base64, hashlib, shutil, sys, zipfile
from pathlib import Path

tmp, out = Path(sys.argv[1]), Path(sys.argv[2])
DROP = {  # wheel name prefix -> member prefixes nothing imports when serving with triton attention
    "sglang_kernel-": ("sgl_kernel/flash_ops", "sgl_kernel/flashmla_ops", "sgl_kernel/infllm_ops", "sgl_kernel/sm100/"),
    "xgrammar-": ("xgrammar/lib/libxgrammar.a",),
}
for whl in sorted(tmp.glob("*/*.whl")):
    drop = next((d for p, d in DROP.items() if whl.name.startswith(p)), None)
    if drop is None:
        continue
    slim = whl.with_suffix(".slim")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if info.filename.startswith(drop) or info.filename == record:
                continue
            dst.writestr(info, src.read(info))
        lines = [l for l in src.read(record).decode().splitlines() if l and not l.startswith(drop)]
        dst.writestr(record, "\n".join(lines) + "\n")
    slim.replace(whl)
LIMIT = 60_000_000
wheels = sorted(tmp.glob("*/*.whl"), key=lambda p: -p.stat().st_size)
parts: list[list[Path]] = []
sizes: list[int] = []
for w in wheels:  # first fit, largest first
    n = w.stat().st_size
    i = next((i for i, s in enumerate(sizes) if s + n <= LIMIT), None)
    if i is None:
        parts.append([]), sizes.append(0)
        i = len(parts) - 1
    parts[i].append(w)
    sizes[i] += n
shutil.rmtree(out, ignore_errors=True)
for i, ws in enumerate(parts, 1):
    for w in ws:  # main/ wheels keep their folder: gpu_setup.sh installs them into the main environment
        dest = out / f"part{i}" / w.parent.name
        dest.mkdir(parents=True, exist_ok=True)
        shutil.move(str(w), dest / w.name)
    print(f"{out}/part{i}: {len(ws)} wheels, {sizes[i - 1] / 1e6:.1f} MB")
EOF
    du -sh "$out"
    exit 0
fi

out=.whl/gpu
mkdir -p "$out"
fetch "$out" megatron-core==0.19.2 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types typing-inspection \
    typing-extensions bm25s gguf jsonschema jsonschema-specifications referencing rpds-py click==8.2.1 \
    pytest-asyncio
# scripts/gpu_test.sh spreads the GPU suite over the GPUs with pytest-xdist (and its execnet)
fetch "$out" pytest-xdist==3.8.0 execnet==2.1.2
# agents on the openai SDK (agentrl.rollout.agent; the test files that use it import it)
fetch "$out" openai==2.6.1 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1
# CUDA virtual memory for the colocated engine's sleep and wake (abi3: one wheel for every Python 3)
fetch "$out" torch-memory-saver==0.0.10
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/site"
fetch "$tmp" ray==2.52.1
# the archive is written beside site/, never inside the folder tar is reading
(cd "$tmp/site" && unzip -q ../ray-*.whl && rm -rf ray/jars ray/rllib ray/dashboard/client \
    && tar cf - . | gzip -6 > ../ray_site.tar.gz)
mv "$tmp/ray_site.tar.gz" "$out/"
du -sh "$out"
