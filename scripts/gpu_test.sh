#!/usr/bin/env bash
# The GPU test suite (pytest -m gpu), spread over this machine's GPUs, in one command:
#
#   bash scripts/gpu_test.sh [PYTEST ARGS...]        e.g. -k sglang, or tests/test_gpu_lora.py
#   bash scripts/gpu_test.sh --dry-run [...]         print the GPU layout and the pytest commands, run nothing
#
# The GPUs are those CUDA_VISIBLE_DEVICES names, else every one nvidia-smi lists. With one GPU: one pytest
# run, one pytest-xdist worker. With more (agentrl.testing.gpus.suite_phases): two runs, the tests needing
# one GPU with every GPU a worker of its own, then those needing more (@pytest.mark.gpus(N)) with workers
# holding N GPUs each. Each worker is pinned to its GPUs with CUDA_VISIBLE_DEVICES (tests/conftest.py) and
# takes whole groups of tests that share a server (tests/_xdist_gpus.py). A test needing more GPUs than a
# worker holds is skipped, with the reason in the summary. The exit status is the first failing run's (a
# run that selects no test counts as passing when the other ran some). pytest-xdist comes with
# scripts/gpu_wheels.sh.
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
# the most GPUs one test needs (@pytest.mark.gpus(N))
# (test_xdist_gpus.py is a CPU test whose stand-in suite needs more GPUs than there are)
largest=$(grep -rhoE 'mark\.gpus\([0-9]+' tests --include='*.py' --exclude=test_xdist_gpus.py \
    | grep -oE '[0-9]+$' | sort -n | tail -1 || true)
mapfile -t runs < <(python -m agentrl.testing.gpus "$gpus" "${largest:-1}")
[ "$dry" -eq 1 ] || python -c 'import xdist' 2>/dev/null \
    || { echo "pytest-xdist is not installed (bash scripts/gpu_setup.sh)" >&2; exit 1; }
status=0
ran=0
for run in "${runs[@]}"; do
    phase=${run%% *}
    layout=${run#* }
    [ "$phase" != "-" ] || phase=""
    workers=$(tr ';' '\n' <<<"$layout" | grep -c .)
    cmd=(python -m pytest -m gpu -n "$workers" --dist loadgroup "$@")
    case $phase in
        one) what=", tests needing one GPU" ;;
        many) what=", tests needing more than one GPU" ;;
        *) what="" ;;
    esac
    echo "GPUs $gpus$what: $workers worker(s), their GPUs $layout"
    echo "AGENTRL_TEST_PHASE='$phase' AGENTRL_TEST_GPUS='$layout' ${cmd[*]}"
    [ "$dry" -eq 0 ] || continue
    rc=0
    AGENTRL_TEST_PHASE=$phase AGENTRL_TEST_GPUS=$layout "${cmd[@]}" || rc=$?
    if [ "$rc" -eq 0 ]; then
        ran=1
    elif [ "$rc" -ne 5 ] && [ "$status" -eq 0 ]; then # 5: this run selected no test
        status=$rc
    fi
done
[ "$dry" -eq 0 ] || exit 0
[ "$status" -ne 0 ] || [ "$ran" -eq 1 ] || status=5
exit "$status"
