#!/usr/bin/env bash
# Install agentrl on a GPU machine that reaches no package index, from the bundles scripts/gpu_wheels.sh built.
#
#   bash scripts/gpu_setup.sh                  .whl/gpu into the running Python's environment (+ Ray), agentrl
#                                              editable without dependencies (torch, transformers, aiohttp,
#                                              httpx, pyarrow and matplotlib come with the GPU image)
#   bash scripts/gpu_setup.sh --sglang [DIR]   the SGLang bundle (DIR: the folder holding part1/, part2/, ...;
#                                              default .whl/sglang) into a directory of its own
#
# SGLang goes into $AGENTRL_SGLANG_SITE (default $AGENTRL_CACHE/sglang, AGENTRL_CACHE defaulting to
# ~/.cache/agentrl) with `pip install --target`: only the SGLang server processes get it on PYTHONPATH
# (agentrl.engine.launcher finds it there), so its transformers and tokenizers pins never reach the
# trainer, which keeps the image's. The router and its web stack (each part's main/) go into the main
# environment. SGLang compiles kernels at first use through tvm-ffi, which needs CUDA_HOME: the launcher
# sets it from nvcc when it is unset; this script prints the value it will use.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_install=(python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)

if [ "${1:-}" = "--sglang" ]; then
    src=${2:-.whl/sglang}
    site=${AGENTRL_SGLANG_SITE:-${AGENTRL_CACHE:-$HOME/.cache/agentrl}/sglang}
    shopt -s nullglob
    site_wheels=("$src"/part*/site/*.whl)
    main_wheels=("$src"/part*/main/*.whl)
    [ ${#site_wheels[@]} -gt 0 ] || { echo "no SGLang wheels under $src/part*/site (run scripts/gpu_wheels.sh --sglang)"; exit 1; }
    rm -rf "$site"
    mkdir -p "$site"
    "${pip_install[@]}" --target "$site" "${site_wheels[@]}"
    [ ${#main_wheels[@]} -eq 0 ] || "${pip_install[@]}" "${main_wheels[@]}"
    nvcc=$(command -v nvcc || true)
    cuda_home=${CUDA_HOME:-${nvcc:+$(dirname "$(dirname "$nvcc")")}}
    echo "SGLang installed into $site; CUDA_HOME for its kernel builds: ${cuda_home:-none found (set CUDA_HOME)}"
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python -c 'import importlib.metadata as m, sglang, transformers
print("sglang", m.version("sglang"), "transformers", transformers.__version__, "from", transformers.__file__)'
    exit 0
fi

"${pip_install[@]}" .whl/gpu/*.whl
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
tar xzf .whl/gpu/ray_site.tar.gz -C "$site"
python -m pip install -q --no-deps --no-build-isolation --no-index -e .
python -c 'import ray, megatron.core, pydantic, agentrl; print("ray", ray.__version__, "megatron-core", megatron.core.__version__)'
