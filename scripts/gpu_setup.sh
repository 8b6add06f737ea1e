#!/usr/bin/env bash
# Install agentrl on a GPU machine that reaches no package index, from .whl/gpu (built by
# scripts/gpu_wheels.sh and copied with the checkout): the wheels go into the running Python's
# environment, Ray is unpacked into its site-packages, agentrl is installed editable without dependencies
# (torch, transformers, aiohttp, httpx, pyarrow and matplotlib come with the GPU image).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/gpu/*.whl
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
tar xzf .whl/gpu/ray_site.tar.gz -C "$site"
python -m pip install -q --no-deps --no-build-isolation --no-index -e .
python -c 'import ray, megatron.core, pydantic, agentrl; print("ray", ray.__version__, "megatron-core", megatron.core.__version__)'
