"""The /retrieve server as processes: N workers sharing one port, their shared counters, and their load.

:func:`start_retrieval_server` starts ``workers`` server processes (:mod:`.retrieval_server`) on one port.
The first builds or loads the cached index and binds the port; the others then bind the same port with
``SO_REUSEPORT``, and the kernel spreads incoming connections over them (Linux). Every worker
memory-maps the cached index read-only, so N workers hold one copy of it in the page cache, not N. A
search is CPU-bound Python (one core per process, the GIL), so N workers search N queries at once where
one worker queued them. Each worker exits with the process that started it; :meth:`RetrievalServer.stop`
stops them all.

The workers count their work in a :class:`StatsBoard`: one row of cumulative counters per worker in a
small file with no name, shared by the starter and the workers (each writes only its own row), so
``GET /stats`` on the shared port answers the totals of all workers whichever worker takes it.
:class:`RetrievalLoad` turns two reads of ``/stats`` into the server's load over the window between them,
the ``retrieval/*`` figures a run logs each step (see its docstring).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import IO, Any

import numpy as np

from agentrl.cluster import API_KEY_ENV, bind_address

log = logging.getLogger(__name__)

FIELDS = (
    "requests",  # /retrieve requests searched (a rejected one counts as an error instead)
    "queries",  # queries in them
    "errors",  # /retrieve requests answered 4xx/5xx
    "request_s",  # server-side seconds per request, summed: read -> response built
    "queue_s",  # of which waiting for the worker's search thread, summed
    "search_s",  # seconds the search thread spent searching (batches of queued requests)
    "cpu_s",  # the worker process's CPU time
    "inflight",  # /retrieve requests in the worker now
    "started",  # the worker's start (time.monotonic)
)
_COL = {name: i for i, name in enumerate(FIELDS)}


class StatsBoard:
    """Cumulative counters of each worker of one server, one float64 row each, in a shared memory map.

    ``StatsBoard(workers)`` makes the board (a file with no name, nothing left on disk); a worker opens it
    by the inherited ``fd`` with its ``index`` and writes only its own row, so no lock is needed (aligned
    8-byte stores are never torn). A server started without a board gets a private one-row board."""

    def __init__(self, workers: int = 1, fd: int | None = None, index: int = 0) -> None:
        if not 0 <= index < workers:
            raise ValueError(f"worker index {index} outside [0, {workers})")
        self.workers, self.index = workers, index
        size = workers * len(FIELDS) * 8
        self._file: IO[bytes] | None = None
        if fd is None:
            self._file = tempfile.TemporaryFile(prefix="agentrl-retrieval-stats-")
            self._file.truncate(size)
            fd = self._file.fileno()
        self.fd = fd
        self._mm = mmap.mmap(fd, size)
        self._rows: Any = np.frombuffer(self._mm, dtype=np.float64).reshape(workers, len(FIELDS))
        self._cpu0 = 0.0

    def begin(self) -> None:
        """The worker starts serving: ``started`` is now, ``cpu_s`` counts from here (not the index build)."""
        self._cpu0 = time.process_time()
        self.set("started", time.monotonic())
        self.set("cpu_s", 0.0)

    def tick(self) -> None:
        """Bring this worker's ``cpu_s`` up to date."""
        self.set("cpu_s", time.process_time() - self._cpu0)

    def add(self, field: str, value: float = 1.0) -> None:
        self._rows[self.index, _COL[field]] += value

    def set(self, field: str, value: float) -> None:
        self._rows[self.index, _COL[field]] = value

    def totals(self) -> dict[str, Any]:
        """Every counter summed over the workers (``started``: the earliest), ``workers``, ``time`` (now,
        ``time.monotonic``: one clock for all processes of a machine) and ``per_worker`` rows."""
        rows = self._rows.copy()
        out: dict[str, Any] = {name: float(rows[:, i].sum()) for i, name in enumerate(FIELDS)}
        out["started"] = float(rows[:, _COL["started"]].min())
        out["workers"] = self.workers
        out["time"] = time.monotonic()
        out["per_worker"] = [dict(zip(FIELDS, map(float, r), strict=True)) for r in rows]
        return out

    def close(self) -> None:
        self._rows = None  # the array holds the map's buffer: it goes first
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._file is not None:
            self._file.close()


class RetrievalLoad:
    """The retrieval server's own load between two reads of its ``GET /stats``, for a run's metrics.

    :meth:`read` returns, for the window since the previous read (the first: since the server started):

    * ``retrieval/busy_frac``: CPU time of the server's processes / (wall time x workers). A worker is
      one core at most (the GIL), so near 1 its requests queue; more workers would help.
    * ``retrieval/request_ms_mean``: server-side time per request (read to response, in the worker);
      ``retrieval/queue_ms_mean``: of which waiting for the search thread. The client's search latency
      (``rollout/tool_latency_mean_s``) minus this is time on the wire and in the client's event loop.
    * ``retrieval/inflight_mean``: requests in the server on average (Little's law: summed request time
      / wall time); ``retrieval/inflight``: at the read.
    * ``retrieval/requests_per_s``, ``retrieval/workers``.

    A server without ``/stats`` (another implementation of the API) gives ``{}``, said once in the log.
    ``api_key``: the server's key, when it requires one."""

    def __init__(self, url: str, timeout: float = 2.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/").removesuffix("/retrieve") + "/stats"
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._prev: dict[str, Any] | None = None
        self._off = False
        # a loopback GET: never through a proxy from the environment
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def fetch(self) -> dict[str, Any]:
        request = urllib.request.Request(self.url, headers=self.headers)
        with self._opener.open(request, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def read(self) -> dict[str, float]:
        if self._off:
            return {}
        try:
            now = self.fetch()
        except (OSError, ValueError) as err:
            self._off = True
            log.warning(
                "retrieval server %s gives no load figures (%s): no retrieval/* figures", self.url, err
            )
            return {}
        prev = self._prev or {"time": now["started"]}
        self._prev = now
        d = {k: float(now[k]) - float(prev.get(k, 0.0)) for k in (*FIELDS, "time")}
        if d["time"] <= 0 or min(d["requests"], d["cpu_s"]) < 0:  # a restarted server: start again
            return {}
        workers = max(1, int(now["workers"]))
        per_request = 1000.0 / d["requests"] if d["requests"] else 0.0
        return {
            "retrieval/workers": float(workers),
            "retrieval/requests_per_s": d["requests"] / d["time"],
            "retrieval/busy_frac": min(1.0, max(0.0, d["cpu_s"] / (d["time"] * workers))),
            "retrieval/request_ms_mean": d["request_s"] * per_request,
            "retrieval/queue_ms_mean": d["queue_s"] * per_request,
            "retrieval/inflight_mean": d["request_s"] / d["time"],
            "retrieval/inflight": float(now["inflight"]),
        }


# --------------------------------------------------------------------------------------------------------
# Worker processes

_LIVE: set[RetrievalServer] = set()


class _Worker:
    """One server process: its stdout read by a thread (also drained after the ready line, so the pipe
    never fills) and its stderr in a file with no name (gone once closed; a failed start shows its tail)."""

    def __init__(self, cmd: list[str], pass_fds: tuple[int, ...], env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log = tempfile.TemporaryFile(prefix="agentrl-retrieval-", suffix=".log")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
            text=True,
            pass_fds=pass_fds,
            env=None if env is None else {**os.environ, **env},
        )
        self.lines: list[str] = []
        out = self.proc.stdout
        threading.Thread(target=lambda: self.lines.extend(iter(out.readline, "")), daemon=True).start()

    def ready(self) -> dict[str, Any] | None:
        for line in list(self.lines):
            with contextlib.suppress(json.JSONDecodeError):
                info = json.loads(line)
                if isinstance(info, dict) and info.get("event") == "ready":
                    return info
        return None

    def wait_ready(self, deadline: float) -> dict[str, Any]:
        while time.monotonic() < deadline and self.proc.poll() is None:
            info = self.ready()
            if info is not None:
                return info
            time.sleep(0.02)
        info = self.ready()  # printed just before the time ran out
        if info is not None and self.proc.poll() is None:
            return info
        state = "timed out" if self.proc.poll() is None else f"exited with code {self.proc.returncode}"
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace")[-3000:]
        self.log.close()
        raise RuntimeError(f"retrieval server {state} before it was ready ({' '.join(self.cmd)}):\n{tail}")

    def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s; always reaps it. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class RetrievalServer:
    """Handle to a retrieval server's worker processes: ``.url``, ``.pid`` (the first worker's), ``.pids``,
    ``.stats()`` (the workers' counters, as ``GET /stats`` answers them), ``.stop()``; a context manager."""

    def __init__(self, workers: list[_Worker], url: str, info: dict[str, Any], board: StatsBoard) -> None:
        self._workers, self.url, self.info, self.board = workers, url, info, board
        self.proc = workers[0].proc
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def stats(self) -> dict[str, Any]:
        return self.board.totals()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every worker (SIGTERM to all, then SIGKILL after ``timeout`` s); always reaps them.
        Idempotent."""
        _LIVE.discard(self)
        for w in self._workers:  # all asked at once: they shut down in parallel
            if w.proc.poll() is None:
                w.proc.terminate()
        for w in self._workers:
            w.stop(timeout)
        self.board.close()

    def __enter__(self) -> RetrievalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(timeout=2.0)


def start_retrieval_server(
    corpus_path: str | os.PathLike[str],
    port: int = 0,
    host: str = "127.0.0.1",
    timeout: float = 120.0,
    limits: Any = None,
    workers: int = 1,
    api_key: str | None = None,
) -> RetrievalServer:
    """Start the server's ``workers`` processes on one port and wait until all serve; returns the handle.

    ``limits`` is a :class:`~.retrieval_server.ServerLimits` (default: its defaults). More than one worker
    needs ``SO_REUSEPORT`` balancing (Linux). The workers exit when this process exits (each watches its
    parent), so they cannot outlive a crash. ``host`` may be :data:`agentrl.cluster.NODE` (this node's
    routable address); off loopback ``api_key`` is required, and reaches the workers in their environment.
    """
    from .retrieval_server import ServerLimits  # the server module imports this one

    if workers < 1:
        raise ValueError(f"retrieval workers must be at least 1, got {workers}")
    if workers > 1 and not sys.platform.startswith("linux"):
        raise ValueError(f"{workers} retrieval workers need SO_REUSEPORT balancing (Linux); use 1 here")
    limits = limits or ServerLimits()
    board = StatsBoard(workers)
    base = [
        sys.executable,
        "-m",
        "agentrl.examples.search_r1.retrieval_server",
        "--corpus",
        str(corpus_path),
        "--host",
        bind_address(host),
        "--parent-pid",
        str(os.getpid()),
        "--max-queries",
        str(limits.max_queries),
        "--max-topk",
        str(limits.max_topk),
        "--max-query-chars",
        str(limits.max_query_chars),
        "--max-body-bytes",
        str(limits.max_body_bytes),
        "--default-topk",
        str(limits.default_topk),
        "--workers",
        str(workers),
        "--board-fd",
        str(board.fd),
    ]
    key_env = {API_KEY_ENV: api_key} if api_key else None
    started: list[_Worker] = []
    deadline = time.monotonic() + timeout

    def spawn(index: int, at_port: int) -> _Worker:
        extra = ["--worker-index", str(index), "--port", str(at_port)]
        reuse = ["--reuse-port"] if workers > 1 else []
        started.append(_Worker(base + extra + reuse, (board.fd,), key_env))
        return started[-1]

    try:
        # the first worker builds (or loads) the cached index and picks the port; the rest load that cache
        info = spawn(0, port).wait_ready(deadline)
        for w in [spawn(i, info["port"]) for i in range(1, workers)]:
            w.wait_ready(deadline)
    except BaseException:
        for w in started:
            w.stop(2.0)
        board.close()
        raise
    return RetrievalServer(started, info["url"], {**info, "workers": workers}, board)
