#!/usr/bin/env bash
# Install agentrl with its test extra, make Docker ready for the sandbox tests when this machine can run
# it (root + apt), then run the whole CPU test suite. GPU tests are behind the `gpu` marker (run by hand).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0 -e '.[test]'
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    bash .ci/docker_setup.sh
    # headless Chromium for the episode viewer's browser tests (they fail, not skip, when it is missing)
    command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
    export AGENTRL_REQUIRE_CHROMIUM=1
else
    echo "not root or no apt-get: Docker sandbox tests will be skipped (set AGENTRL_REQUIRE_DOCKER=1 to fail instead)"
fi
python -m pytest -q "$@"
