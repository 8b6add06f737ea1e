#!/usr/bin/env bash
# Prepare, on a machine with the package index, what a GPU machine without it needs for agentrl:
# Python 3.12 wheels that its image lacks (megatron-core, pydantic, bm25s, gguf, ...) and Ray, packed
# without its Java jars, RLlib and dashboard front-end, which a training run does not use (they make the
# wheel several times larger). Output: .whl/gpu/ (about 41 MB); copy it with the checkout and install it
# on the GPU machine with scripts/gpu_setup.sh. Guide: docs/guide/gpus-and-scaling.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl/gpu
mkdir -p "$out"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$out" megatron-core==0.19.2 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types typing-inspection \
    typing-extensions bm25s gguf jsonschema jsonschema-specifications referencing rpds-py click==8.2.1 \
    pytest-asyncio
# CUDA virtual memory for the colocated engine's sleep and wake (abi3: one wheel for every Python 3)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$out" torch-memory-saver==0.0.10
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/site"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$tmp" ray==2.52.1
# the archive is written beside site/, never inside the folder tar is reading
(cd "$tmp/site" && unzip -q ../ray-*.whl && rm -rf ray/jars ray/rllib ray/dashboard/client \
    && tar cf - . | gzip -6 > ../ray_site.tar.gz)
mv "$tmp/ray_site.tar.gz" "$out/"
du -sh "$out"
