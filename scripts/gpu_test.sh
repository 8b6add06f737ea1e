#!/usr/bin/env bash
# The GPU test suite (pytest -m gpu), spread over this machine's GPUs, in one command:
#
#   bash scripts/gpu_test.sh [PYTEST ARGS...]        e.g. -k sglang, or tests/test_gpu_lora.py
#   bash scripts/gpu_test.sh --dry-run [...]         print the GPU layout and the pytest command, run nothing
#
# The GPUs are those CUDA_VISIBLE_DEVICES names, else every one nvidia-smi lists. One pytest-xdist worker
# per GPU, except the first, which holds as many as the most a test needs (agentrl.testing.gpus.worker_gpus;
# with @pytest.mark.gpus(2) four GPUs give workers on 0+1, on 2 and on 3). Each worker is pinned to its
# GPUs with CUDA_VISIBLE_DEVICES (tests/conftest.py) and takes whole groups of tests that share a server
# (tests/_xdist_gpus.py). A test needing more GPUs than the machine has is skipped, with the reason in the
# summary. pytest-xdist comes with scripts/gpu_wheels.sh.
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
# the most GPUs one test needs (@pytest.mark.gpus(N)): the first worker holds that many
# (test_xdist_gpus.py is a CPU test whose stand-in suite needs more GPUs than there are)
largest=$(grep -rhoE 'mark\.gpus\([0-9]+' tests --include='*.py' --exclude=test_xdist_gpus.py \
    | grep -oE '[0-9]+$' | sort -n | tail -1 || true)
layout=$(python -m agentrl.testing.gpus "$gpus" "${largest:-1}")
workers=$(tr ';' '\n' <<<"$layout" | grep -c .)
cmd=(python -m pytest -m gpu -n "$workers" --dist loadgroup "$@")
echo "GPUs $gpus: $workers worker(s), their GPUs $layout"
echo "AGENTRL_TEST_GPUS='$layout' ${cmd[*]}"
[ "$dry" -eq 0 ] || exit 0
python -c 'import xdist' 2>/dev/null || { echo "pytest-xdist is not installed (bash scripts/gpu_setup.sh)" >&2; exit 1; }
AGENTRL_TEST_GPUS=$layout exec "${cmd[@]}"
