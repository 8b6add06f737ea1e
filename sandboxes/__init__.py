"""Sandboxes: run untrusted code isolated and bounded. ``DockerSandbox`` (warm container pool) and
``ProcessSandbox`` (bubblewrap/unshare + rlimits) share one contract, :class:`Sandbox`."""

from .base import ExecResult, Sandbox, SandboxConfig, SandboxError, SandboxRunKilled, make_sandbox
from .docker import DockerSandbox, DockerSandboxConfig, docker_available, reap_containers
from .process import ProcessSandbox, ProcessSandboxConfig
from .shared import shared_sandbox

__all__ = [
    "DockerSandbox",
    "DockerSandboxConfig",
    "ExecResult",
    "ProcessSandbox",
    "ProcessSandboxConfig",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxRunKilled",
    "docker_available",
    "make_sandbox",
    "reap_containers",
    "shared_sandbox",
]
