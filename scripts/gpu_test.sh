#!/usr/bin/env bash
# The GPU test suite (pytest -m gpu), spread over this machine's GPUs, in one command:
#
#   bash scripts/gpu_test.sh [PYTEST ARGS...]        e.g. -k sglang, or tests/test_gpu_lora.py
#   bash scripts/gpu_test.sh --dry-run [...]         print the GPU layout and the pytest command, run nothing
#
# The GPUs are those CUDA_VISIBLE_DEVICES names, else every one nvidia-smi lists. One pytest-xdist worker
# per GPU, except the first, which holds a pair for the tests that need two GPUs (4 GPUs: workers on 0+1,
# 2 and 3); each worker is pinned to its own GPUs with CUDA_VISIBLE_DEVICES (tests/conftest.py) and takes
# whole groups of tests that share a server (tests/_xdist_gpus.py). A test needing more GPUs than the
# machine has is skipped, with the reason in the summary. pytest-xdist comes with scripts/gpu_wheels.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
if [ "${1:-}" = "--dry-run" ]; then
    dry=1
    shift
fi
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    gpus=$CUDA_VISIBLE_DEVICES
else
    gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ' | paste -sd, - || true)
fi
count=$(tr ',' '\n' <<<"$gpus" | grep -c . || true)
if [ "$count" -eq 0 ]; then
    echo "no GPU found (nvidia-smi lists none and CUDA_VISIBLE_DEVICES is unset)" >&2
    exit 1
fi
workers=$((count >= 2 ? count - 1 : 1))  # a pair, then one worker per GPU (agentrl.testing.gpus.worker_gpus)
cmd=(python -m pytest -m gpu -n "$workers" --dist loadgroup "$@")
echo "GPUs $gpus: $workers worker(s)"
echo "AGENTRL_TEST_GPUS=$gpus ${cmd[*]}"
[ "$dry" -eq 0 ] || exit 0
python -c 'import xdist' 2>/dev/null || { echo "pytest-xdist is not installed (bash scripts/gpu_setup.sh)" >&2; exit 1; }
AGENTRL_TEST_GPUS=$gpus exec "${cmd[@]}"
