#!/usr/bin/env bash
# Docker for the sandbox tests: install docker.io / debootstrap / bubblewrap when missing, start dockerd
# in the background when no engine answers (and wait for it), and build the sandbox image unless its tag
# already exists. Called by scripts/test.sh (which .ci/run calls with AGENTRL_REQUIRE_DOCKER=1). Needs root
# for the installs.
#   --plan   print the apt packages it would install (space-separated, empty when none) and exit
# When it starts dockerd and AGENTRL_DOCKERD_PIDFILE is set, it writes dockerd's pid there, so that the
# caller can stop the daemon when its tests end (scripts/test.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${AGENTRL_SANDBOX_IMAGE:-agentrl-sandbox:latest}"

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)  # a docker client alone is not enough
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
if [ "${1:-}" = "--plan" ]; then
    echo "${need[*]}"
    exit 0
fi
if [ "${#need[@]}" -gt 0 ]; then
    echo "docker_setup: installing ${need[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

if ! docker info >/dev/null 2>&1; then
    echo "docker_setup: starting dockerd"
    nohup dockerd >/var/log/agentrl-dockerd.log 2>&1 &
    pid=$!
    [ -n "${AGENTRL_DOCKERD_PIDFILE:-}" ] && echo "$pid" >"$AGENTRL_DOCKERD_PIDFILE"
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 || { echo "docker_setup: dockerd did not come up; see /var/log/agentrl-dockerd.log" >&2; exit 1; }
fi

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "docker_setup: image $IMAGE exists"
else
    echo "docker_setup: building the sandbox image $IMAGE"
    python -m agentrl.sandboxes.build_image --tag "$IMAGE"
fi
