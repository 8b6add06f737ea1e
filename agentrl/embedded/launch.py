"""Starting the embedded engine's server from another process: ``python -m agentrl.embedded.server`` as a
subprocess in its own process group, its port read back from a file (no race), ``/health`` awaited, and a
handle to stop it.

This module does not import the engine (nor torch): a process that only starts a server, a Ray actor
holding one for a run or a test, pays for neither. The server itself is :mod:`agentrl.embedded.server`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from agentrl.cluster import API_KEY_ENV, bind_address, require_key_off_loopback
from agentrl.engine._proc import ServerProcess, ServerStartError

__all__ = ["EmbeddedServer", "ServerStartError", "start_embedded_server"]


class EmbeddedServer:
    """Handle of an embedded-engine subprocess (from :func:`start_embedded_server`)."""

    def __init__(self, process: ServerProcess, host: str, port: int, api_key: str | None) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.api_key = api_key
        h = f"[{host}]" if ":" in host else host
        self.url = f"http://{h}:{port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log_file(self) -> Path:
        return self.process.log_file

    def alive(self) -> bool:
        return self.process.alive()

    def stop(self) -> int | None:
        """Stop the server and everything it started (SIGTERM, then SIGKILL, to its process group)."""
        return self.process.stop()

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_embedded_server(
    model_dir: str | Path,
    port: int = 0,
    host: str = "127.0.0.1",
    device: str = "cpu",
    dtype: str = "float32",
    api_key: str | None = None,
    max_batch_size: int = 64,
    extra_args: Sequence[str] = (),
    timeout: float = 600.0,
    log_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> EmbeddedServer:
    """Start ``python -m agentrl.embedded.server`` in its own process group and wait for ``/health``.

    ``port=0`` lets the server pick a free port (reported back through a file, so there is no race).
    ``host`` may be :data:`agentrl.cluster.NODE`: this node's routable address (then ``api_key`` is needed).
    The key reaches the server in its environment, not on its command line.
    Raises :class:`ServerStartError` with the server's log tail if it exits or is not healthy in time (a
    server that exits raises at once; ``timeout`` bounds a slow start: torch's import and the model's load
    on a host whose cores other jobs share).
    """
    host = bind_address(host)
    require_key_off_loopback(host, api_key)
    workdir = Path(tempfile.mkdtemp(prefix="agentrl-engine-"))
    port_file = workdir / "port"
    log_path = Path(log_file) if log_file is not None else workdir / "server.log"
    argv = [
        sys.executable,
        "-m",
        "agentrl.embedded.server",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        dtype,
        "--max-batch-size",
        str(max_batch_size),
        "--port-file",
        str(port_file),
        "--parent-pid",
        str(os.getpid()),
        *extra_args,
    ]
    if api_key:
        env = {**(env or {}), API_KEY_ENV: api_key}
    proc = ServerProcess(argv, log_path, env=env, scratch_dir=workdir)  # removed when it stops
    t0 = time.monotonic()
    proc.wait_until(port_file.exists, timeout, "listening")
    server = EmbeddedServer(proc, host, int(port_file.read_text()), api_key)
    proc.wait_healthy(f"{server.url}/health", timeout=max(1.0, timeout - (time.monotonic() - t0)))
    return server
