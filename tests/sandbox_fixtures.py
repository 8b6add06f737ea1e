"""Shared sandbox test helpers: the Docker requirement switch and a fixture per backend.

Docker tests skip with the reason when no engine/image is there, except under AGENTRL_REQUIRE_DOCKER=1
(CI), where the same situation is a failure.
"""

from __future__ import annotations

import os

import pytest

from agentrl.sandboxes import DockerSandbox, ProcessSandbox
from agentrl.sandboxes.docker import docker_available

IMAGE = os.environ.get("AGENTRL_SANDBOX_IMAGE", "agentrl-sandbox:latest")


def docker_required() -> bool:
    return os.environ.get("AGENTRL_REQUIRE_DOCKER", "") not in ("", "0", "false")


def docker_problem() -> str | None:
    """Why Docker tests cannot run here (None: they can)."""
    if not docker_available():
        return "no Docker engine reachable (start dockerd; CI sets AGENTRL_REQUIRE_DOCKER=1 to fail instead)"
    import docker

    client = docker.from_env()
    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        return f"sandbox image {IMAGE} missing: run `python -m agentrl.sandboxes.build_image`"
    finally:
        client.close()
    return None


def need_docker() -> None:
    """Skip (or, with AGENTRL_REQUIRE_DOCKER=1, fail) when Docker tests cannot run."""
    problem = docker_problem()
    if problem:
        if docker_required():
            pytest.fail(f"AGENTRL_REQUIRE_DOCKER=1 but {problem}")
        pytest.skip(problem)


def make_backend(name: str, **config):
    if name == "docker":
        need_docker()
        config.pop("max_concurrency", None)
        return DockerSandbox(image=IMAGE, **config)
    config.pop("pool_size", None)
    config.pop("max_containers", None)
    return ProcessSandbox(**config)


BACKENDS = [pytest.param("docker", marks=pytest.mark.docker), "process"]
