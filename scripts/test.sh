#!/usr/bin/env bash
# Install agentrl with its test extra, make Docker ready for the sandbox tests when this machine can run
# it (root + apt), then run the whole CPU test suite. GPU tests are behind the `gpu` marker (run by hand).
#
# As root with apt-get, before the tests it installs what is missing of docker.io, debootstrap, bubblewrap
# (.ci/docker_setup.sh) and chromium (the episode viewer's browser tests), all through apt; starts dockerd
# when no Docker engine answers, and stops that daemon again when the tests end; and builds the sandbox
# image (agentrl-sandbox:latest) unless it exists. It names the packages before installing them.
#
#   AGENTRL_SKIP_SYSTEM_SETUP=1 ./scripts/test.sh    no apt, no dockerd, no image build: for a machine that
#                                                   has them (or runs Docker elsewhere); only the pip install
# Arguments go to pytest (./scripts/test.sh tests/test_buffer.py -x). The tests run in two pytest-xdist
# workers; AGENTRL_TEST_WORKERS=1 runs them in one process (AGENTRL_TEST_WORKERS=N in N).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0 -e '.[test]'

dockerd_pidfile=""
stop_dockerd() {  # the daemon this script started, if any; an engine that was already running stays
    [ -n "$dockerd_pidfile" ] || return 0
    if [ -s "$dockerd_pidfile" ]; then
        local pid
        pid=$(cat "$dockerd_pidfile")
        if kill -0 "$pid" 2>/dev/null; then
            echo "test.sh: stopping the dockerd it started (pid $pid)"
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        fi
    fi
    rm -f "$dockerd_pidfile"
}
trap stop_dockerd EXIT
trap 'exit 130' INT TERM  # so that Ctrl-C and a kill run the EXIT trap too

if [ "${AGENTRL_SKIP_SYSTEM_SETUP:-0}" = "1" ]; then
    echo "test.sh: AGENTRL_SKIP_SYSTEM_SETUP=1: no system packages, no dockerd, no sandbox image build"
elif [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    apt_missing="$(bash .ci/docker_setup.sh --plan)"
    command -v chromium >/dev/null || apt_missing="${apt_missing:+$apt_missing }chromium"
    echo "test.sh: system setup for the Docker sandbox and browser tests (AGENTRL_SKIP_SYSTEM_SETUP=1 skips it):"
    echo "  apt packages to install: ${apt_missing:-none, all present}"
    docker info >/dev/null 2>&1 || echo "  dockerd: started for the tests, stopped when they end"
    echo "  sandbox image: ${AGENTRL_SANDBOX_IMAGE:-agentrl-sandbox:latest}, built if absent"
    dockerd_pidfile="$(mktemp)"
    AGENTRL_DOCKERD_PIDFILE="$dockerd_pidfile" bash .ci/docker_setup.sh
    # headless Chromium for the episode viewer's browser tests (they fail, not skip, when it is missing)
    command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
    export AGENTRL_REQUIRE_CHROMIUM=1
else
    echo "test.sh: not root or no apt-get: Docker sandbox tests will be skipped (set AGENTRL_REQUIRE_DOCKER=1 to fail instead)"
fi
# two pytest-xdist workers (one on a 1-core machine; AGENTRL_TEST_WORKERS=N for N, 1 for one process); a
# module's tests that share a module-scoped fixture stay on one worker (tests/conftest.py)
workers=${AGENTRL_TEST_WORKERS:-$(($(nproc) < 2 ? 1 : 2))}
xdist=()
if [ "$workers" -gt 1 ]; then
    xdist=(-n "$workers" --dist loadgroup)
fi
# the slowest tests by wall time and by CPU time (the suite is CPU-bound: a test's wall time on two busy
# cores says as much about what ran beside it)
python -m pytest -q "${xdist[@]}" --durations=25 --cpu-durations=25 "$@"
