"""The Sandbox contract: run untrusted model-written code or commands, isolated, bounded, and cleaned up.

``await sandbox.run(code)`` runs Python source; ``await sandbox.run(command=[...])`` runs an argv. Both
accept ``files={relative_path: str | bytes}`` (written into the fresh working directory first) and
``timeout=`` seconds. The answer is always an :class:`ExecResult`; a sandbox never raises for what the
code did (crash, timeout, memory blow-up, output flood). It raises :class:`SandboxError` only when the
sandbox itself cannot work (no Docker engine, no image, bad arguments).

Sandboxes are async context managers; ``await close()`` releases every container or process they own.
"""

from __future__ import annotations

import importlib
import posixpath
import signal
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from agentrl.config import ConfigModel
from agentrl.registry import Registry

Files = dict[str, str | bytes]


class SandboxError(RuntimeError):
    """The sandbox backend itself failed (not the code it ran)."""


class SandboxRunKilled(RuntimeError):
    """Raised by a tool whose sandboxed run was stopped (timeout, memory, CPU, a signal): the call is then an
    error result, which the env's records and the rollout's metrics count; its text is what the model sees."""


@dataclass
class ExecResult:
    """What one sandboxed run produced.

    ``exit_code`` is the process's exit status, shell style on every backend (128 + N: killed by signal
    N; None: no status, e.g. killed at the timeout). ``killed_reason`` says why the sandbox stopped it:
    ``"timeout"``, ``"memory"`` (out of memory), ``"cpu"`` (CPU-time limit), ``"signal:N"``, or
    ``"sandbox_error: ..."``; None when it exited on its own. Output is decoded UTF-8 (invalid bytes replaced)
    and capped with a visible marker.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    killed_reason: str | None = None
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.killed_reason is None

    def text_or_raise(self) -> str:
        """:meth:`as_text` for a run that ended on its own; :class:`SandboxRunKilled` (with that text) for
        one the sandbox stopped, so that a tool reports it as a failed call rather than a normal result."""
        if self.timed_out or self.killed_reason:
            raise SandboxRunKilled(self.as_text())
        return self.as_text()

    def as_text(self) -> str:
        """A compact text rendering for a model observation."""
        parts = []
        if self.stdout:
            parts.append(self.stdout)
        if self.stderr:
            parts.append(f"[stderr]\n{self.stderr}")
        if self.timed_out:
            parts.append(f"[killed: timeout after {self.duration:.1f}s]")
        elif self.killed_reason:
            parts.append(f"[killed: {self.killed_reason}]")
        elif self.exit_code not in (0, None):
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


class SandboxConfig(ConfigModel):
    """Limits shared by every backend."""

    timeout: float = Field(10.0, gt=0, description="default wall-clock limit per run, seconds")
    memory_mb: int = Field(
        512, ge=16, description="memory limit per run (cgroup for Docker, RLIMIT_AS for processes)"
    )
    cpus: float = Field(
        1.0, gt=0, description="CPU share (Docker --cpus); processes get an RLIMIT_CPU of timeout+1 s"
    )
    pids: int = Field(64, ge=4, description="max processes/threads a run may have alive")
    max_output_bytes: int = Field(
        64_000, ge=256, description="stdout and stderr are each cut to this many bytes"
    )
    workdir: str = Field(
        "/work", description="working directory inside the sandbox (a fresh tmpfs/dir per run)"
    )
    workdir_mb: int = Field(64, ge=1, description="size of the working-directory tmpfs / max file size")
    python: str = Field("python3", description="python interpreter used for run(code)")


TRUNCATION_MARKER = "\n[... truncated {n} bytes ...]\n"


class OutputCap:
    """Collects a byte stream up to ``limit`` bytes and counts (but drops) the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.dropped = 0

    def feed(self, chunk: bytes) -> None:
        room = self.limit - len(self.buf)
        if room > 0:
            self.buf += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        out = self.buf.decode("utf-8", errors="replace")
        if self.dropped:
            out += TRUNCATION_MARKER.format(n=self.dropped)
        return out


def check_files(files: Files | None) -> dict[str, bytes]:
    """Validate ``files`` paths (relative, no ``..``) and encode the contents to bytes."""
    out: dict[str, bytes] = {}
    for name, content in (files or {}).items():
        norm = posixpath.normpath(name)
        if not name or posixpath.isabs(name) or norm.startswith("..") or norm == ".":
            raise SandboxError(f"file path {name!r} must be relative and stay inside the work dir")
        if isinstance(content, str):
            content = content.encode()
        if not isinstance(content, bytes | bytearray):
            raise SandboxError(f"file {name!r}: content must be str or bytes, got {type(content).__name__}")
        out[norm] = bytes(content)
    return out


def signal_reason(exit_code: int | None) -> str | None:
    """``killed_reason`` for a process that died of a signal we did not send (exit code 128 + N)."""
    if exit_code is None or not 128 < exit_code < 128 + 65:
        return None
    sig = exit_code - 128
    if sig == signal.SIGKILL:
        return "memory"  # the only SIGKILL we do not send ourselves is the kernel's OOM killer
    if sig == signal.SIGXCPU:
        return "cpu"
    if sig == signal.SIGXFSZ:
        return "file_size"
    return f"signal:{sig}"


class Sandbox(ABC):
    """Base of the backends. Subclasses implement ``_run`` and ``close``."""

    config: SandboxConfig

    async def run(
        self,
        code: str | None = None,
        *,
        command: list[str] | None = None,
        files: Files | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Run Python ``code`` or an argv ``command`` (exactly one) with ``files`` in a fresh work dir."""
        if (code is None) == (command is None):
            raise SandboxError("pass exactly one of code=... or command=[...]")
        if command is not None and (
            not isinstance(command, list | tuple)
            or not command
            or not all(isinstance(a, str) for a in command)
        ):
            raise SandboxError(f"command must be a non-empty list of str, got {command!r}")
        payload = check_files(files)
        if code is not None:
            if not isinstance(code, str):
                raise SandboxError(f"code must be str, got {type(code).__name__}")
            if "main.py" in payload:
                raise SandboxError("files must not contain main.py when code is given (the code is main.py)")
            payload["main.py"] = code.encode()
            command = [self.config.python, "main.py"]
        limit = float(timeout if timeout is not None else self.config.timeout)
        if limit <= 0:
            raise SandboxError(f"timeout must be > 0, got {limit}")
        return await self._run(list(command), payload, limit)

    @abstractmethod
    async def _run(self, command: list[str], files: dict[str, bytes], timeout: float) -> ExecResult: ...

    @abstractmethod
    async def close(self) -> None:
        """Release every container/process this sandbox owns. Idempotent."""

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


SANDBOX_BACKENDS: Registry[Callable[..., Sandbox]] = Registry(
    "sandbox backend",
    builtins=lambda: [importlib.import_module(f"agentrl.sandboxes.{m}") for m in ("docker", "process")],
)


def make_sandbox(backend: str = "auto", **config: Any) -> Sandbox:
    """A sandbox of a registered backend (``"docker"``, ``"process"``, a ``"module:Class"`` path, or one
    added with ``@SANDBOX_BACKENDS.register``), or ``"auto"``: Docker when an engine answers, else process."""
    if backend == "auto":
        from .docker import docker_available

        backend = "docker" if docker_available() else "process"
    try:
        factory = SANDBOX_BACKENDS.get(backend)
    except KeyError as err:
        raise SandboxError(f"{err.args[0]}; or 'auto'") from None
    return factory(**config)
