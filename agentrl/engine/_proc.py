"""A server child process that leaves no orphans: its own process group, a health wait that fails fast
with the log tail, and a stop that signals the whole group (SIGTERM, then SIGKILL) and then removes the
scratch directory the process was given (port file, default log), so nothing is left in the temp dir.

Shared by the SGLang launcher and the embedded engine's ``start_embedded_server``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


class ServerStartError(RuntimeError):
    """The server process exited or never became healthy; the message carries its log tail."""


def tail(path: str | Path | None, n: int = 40) -> str:
    if path is None:
        return ""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def http_ok(url: str, timeout: float = 2.0, api_key: str | None = None) -> bool:
    """GET ``url`` -> True on a 2xx answer (loopback health checks; no proxies)."""
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ServerProcess:
    """One child server in its own session/process group."""

    def __init__(
        self,
        argv: Sequence[str],
        log_file: str | Path,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        scratch_dir: str | Path | None = None,
    ) -> None:
        """``scratch_dir``: a directory this process owns; :meth:`stop` removes it (also when the start
        fails here)."""
        self.scratch_dir = None if scratch_dir is None else Path(scratch_dir)
        try:
            self._start(argv, log_file, env, cwd)
        except BaseException:
            self._remove_scratch()
            raise

    def _start(
        self,
        argv: Sequence[str],
        log_file: str | Path,
        env: Mapping[str, str] | None,
        cwd: str | Path | None,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.log_file = Path(log_file)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        full_env = dict(os.environ)
        if env:
            full_env.update({k: str(v) for k, v in env.items()})
        with open(self.log_file, "ab") as log:
            # start_new_session: the child leads a new process group, so stop() reaches its children too,
            # and a Ctrl-C in our terminal does not hit it twice.
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=None if cwd is None else str(cwd),
                start_new_session=True,
            )
        self.pgid = self.proc.pid  # leader of its own group
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``ready()`` until True; raise :class:`ServerStartError` with the log tail (and stop the
        process) if it exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            code = self.proc.poll()
            if code is not None:
                log = self._stop_keeping_log()
                raise ServerStartError(
                    f"server exited with code {code} before {what}: {' '.join(self.argv)}\n"
                    f"--- last lines of {self.log_file} ---\n{log}"
                )
            if ready():
                return
            if time.monotonic() > deadline:
                log = self._stop_keeping_log()
                raise ServerStartError(
                    f"server not {what} after {timeout:.0f}s: {' '.join(self.argv)}\n"
                    f"--- last lines of {self.log_file} ---\n{log}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def wait_healthy(self, url: str, timeout: float, api_key: str | None = None) -> None:
        """Poll ``url`` until it answers 2xx (see :meth:`wait_until`)."""
        self.wait_until(lambda: http_ok(url, api_key=api_key), timeout, f"healthy at {url}")

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the whole process group, SIGKILL whatever is left after ``grace`` seconds."""
        _LIVE.discard(self)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # Children may outlive a leader that exited on SIGTERM: always sweep the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace)
        self._remove_scratch()
        return self.proc.returncode

    def _stop_keeping_log(self) -> str:
        """Stop the server and return its log tail (read after the stop, before the scratch goes)."""
        scratch, self.scratch_dir = self.scratch_dir, None
        self.stop()
        log = tail(self.log_file)
        self.scratch_dir = scratch
        self._remove_scratch()
        return log

    def _remove_scratch(self) -> None:
        if self.scratch_dir is not None:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)


@atexit.register
def _stop_all() -> None:
    for p in list(_LIVE):
        with contextlib.suppress(Exception):
            p.stop(grace=3.0)
