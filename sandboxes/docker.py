"""DockerSandbox: runs each call in a warm, locked-down container from a pool.

Every container is created with ``--network none``, memory (no swap) / CPU / pids limits, a read-only root
with tmpfs work and tmp dirs, a non-root user, all capabilities dropped and ``no-new-privileges``. A run is
a ``docker exec`` in an idle container; its stdout/stderr are capped while streaming, and a run past its
timeout is stopped by killing the whole container. After a clean run the container is scrubbed (all its
processes killed, tmpfs dirs emptied) before it goes back to the pool; after any fault it is destroyed and
replaced. Nothing leaks: every container carries the label ``agentrl=1`` plus its owner's pid, process
start time and session id, and a reaper removes (1) containers of dead owners when a sandbox starts and
(2) this process's containers at ``close()`` and at interpreter exit.

Blocking docker SDK calls run in a dedicated thread pool, off the event loop (the default executor has
only ``cpu_count + 4`` threads, which would cap concurrency on small machines).
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import Field

from .base import SANDBOX_BACKENDS, ExecResult, OutputCap, Sandbox, SandboxConfig, SandboxError, signal_reason

log = logging.getLogger(__name__)

LABEL = "agentrl"
LABEL_OWNER = "agentrl.owner"  # "<host>:<pid>:<process start time>"
LABEL_SESSION = "agentrl.session"
LABEL_SANDBOX = "agentrl.sandbox"  # one DockerSandbox instance
SESSION_ID = uuid.uuid4().hex[:12]

# Runs inside the container when the run has files: decode the payload from argv, write the files into
# the (fresh) work dir, then exec the real command. argv avoids `docker cp`, which cannot write to tmpfs.
_BOOT = (
    "import base64,json,os,sys\n"
    "d=json.loads(base64.b64decode(''.join(sys.argv[1:])))\n"
    "for n,c in d['f'].items():\n"
    " os.makedirs(os.path.dirname(n) or '.',exist_ok=True)\n"
    " open(n,'wb').write(base64.b64decode(c))\n"
    "os.execvp(d['a'][0],d['a'])\n"
)
_ARG_CHUNK = 100_000  # under the kernel's 128 KiB per-argument limit
_MAX_PAYLOAD = 1_500_000  # under ARG_MAX (2 MiB) with room for the environment


def _owner_tag(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{_proc_start_time(pid)}"


def _proc_start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22: starttime
    except (OSError, IndexError):
        return "?"


def _owner_alive(tag: str) -> bool:
    """True when the owner process of a container is (or may be) still running."""
    try:
        host, pid, start = tag.split(":")
    except ValueError:
        return False
    if host != socket.gethostname():
        return True  # another machine sharing this engine: not ours to judge
    return _proc_start_time(int(pid)) == start


class DockerSandboxConfig(SandboxConfig):
    """Docker backend settings (plus the shared limits of :class:`SandboxConfig`)."""

    image: str = Field(
        "agentrl-sandbox:latest", description="image (build with python -m agentrl.sandboxes.build_image)"
    )
    pool_size: int = Field(2, ge=0, description="containers started ahead of time and kept warm")
    max_containers: int = Field(16, ge=1, description="most containers alive at once (= concurrent runs)")
    user: str = Field("65534:65534", description="uid:gid the code runs as (never root)")
    tmp_mb: int = Field(16, ge=1, description="size of the /tmp tmpfs")
    runtime: str | None = Field(
        None, description="container runtime, e.g. 'runsc' for gVisor; None: engine default"
    )
    docker_timeout: float = Field(60.0, gt=0, description="timeout of a single Docker API call, seconds")


_LIVE: weakref.WeakSet[DockerSandbox] = weakref.WeakSet()


def docker_available() -> bool:
    """True when a Docker engine answers a ping."""
    try:
        import docker

        client = docker.from_env(timeout=5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def reap_containers(client: Any = None, *, session: str | None = None, dead_owners: bool = True) -> int:
    """Remove agentrl containers: those of ``session`` and/or those whose owner process is gone.

    Returns how many were removed. Safe to call any time (it is what runs at start and at exit).
    """
    import docker

    own = client is None
    client = client or docker.from_env(timeout=30)
    removed = 0
    try:
        # sparse: the listing's own labels, no inspect per container, so one that another process removes
        # meanwhile (its owner closing its sandbox) is no error
        for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"}, sparse=True):
            labels = c.attrs.get("Labels") or {}
            mine = session is not None and labels.get(LABEL_SESSION) == session
            orphan = dead_owners and not _owner_alive(labels.get(LABEL_OWNER, ""))
            if mine or orphan:
                try:
                    c.remove(force=True)
                    removed += 1
                except docker.errors.NotFound:
                    pass
                except docker.errors.APIError as err:
                    if "already in progress" not in str(err):
                        log.warning("could not remove sandbox container %s: %s", c.short_id, err)
    finally:
        if own:
            client.close()
    return removed


@atexit.register
def _reap_at_exit() -> None:
    if not _LIVE and not _STARTED.is_set():
        return
    try:
        reap_containers(session=SESSION_ID, dead_owners=False)
    except Exception as err:  # the engine may already be gone at exit
        log.debug("exit reaper: %s", err)


_STARTED = threading.Event()  # set once any DockerSandbox created a container in this process


@SANDBOX_BACKENDS.register("docker")
class DockerSandbox(Sandbox):
    """Warm-pool Docker sandbox. ``DockerSandbox()`` works with defaults; see :class:`DockerSandboxConfig`."""

    def __init__(self, config: DockerSandboxConfig | None = None, **overrides: Any) -> None:
        if config is not None and overrides:
            config = config.model_copy(update=overrides)
        self.config = config or DockerSandboxConfig(**overrides)
        self._client: Any = None
        self._executor = ThreadPoolExecutor(
            max_workers=self.config.max_containers * 2 + 4, thread_name_prefix="sbx"
        )
        self._idle: asyncio.Queue[str] = asyncio.Queue()
        self._slots = asyncio.Semaphore(self.config.max_containers)
        self._containers: set[str] = set()  # every container id this sandbox owns
        self._bg: set[asyncio.Task] = set()
        self._start_lock = asyncio.Lock()
        self._started = False
        self._closed = False
        self.stats = {"created": 0, "recycled": 0, "scrubbed": 0}
        self.instance_id = uuid.uuid4().hex[:12]
        _LIVE.add(self)

    # ---- lifecycle ------------------------------------------------------------------------------
    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def start(self) -> None:
        """Connect, reap orphans, check the image and warm the pool. Called lazily by the first run."""
        async with self._start_lock:
            if self._started:
                return
            if self._closed:
                raise SandboxError("sandbox is closed")
            import docker

            try:
                self._client = await self._call(
                    docker.from_env,
                    timeout=self.config.docker_timeout,
                    max_pool_size=self.config.max_containers * 2 + 4,
                )
                await self._call(self._client.ping)
            except Exception as err:
                raise SandboxError(f"no Docker engine reachable: {err}") from err
            try:
                await self._call(self._client.images.get, self.config.image)
            except docker.errors.ImageNotFound:
                raise SandboxError(
                    f"sandbox image {self.config.image!r} not found; build it with "
                    "`python -m agentrl.sandboxes.build_image`"
                ) from None
            n = await self._call(reap_containers, self._client)
            if n:
                log.info("reaped %d leftover sandbox containers of dead processes", n)
            self._started = True
            _STARTED.set()
        if self.config.pool_size:
            ids = await asyncio.gather(
                *(self._create() for _ in range(min(self.config.pool_size, self.config.max_containers)))
            )
            for cid in ids:
                self._idle.put_nowait(cid)

    async def close(self) -> None:
        """Destroy every container of this sandbox (running ones included). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for t in list(self._bg):
            t.cancel()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        if self._client is not None:
            ids = list(self._containers)
            await asyncio.gather(*(self._destroy(cid) for cid in ids), return_exceptions=True)
            # Creations still in flight finish in their threads; wait for them, then sweep by label.
            await asyncio.to_thread(self._executor.shutdown, wait=True)
            await asyncio.to_thread(self._sweep)
            self._client.close()
        else:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _sweep(self) -> None:
        import docker

        for c in self._client.containers.list(
            all=True, filters={"label": f"{LABEL_SANDBOX}={self.instance_id}"}, sparse=True
        ):
            try:
                c.remove(force=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as err:
                log.warning(
                    "could not remove sandbox container %s (the exit reaper retries): %s", c.short_id, err
                )
        self._containers.clear()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and self._containers:
            # No event loop to await on here; the atexit reaper removes the containers.
            log.warning("DockerSandbox garbage-collected without close(); containers are reaped at exit")

    # ---- containers -----------------------------------------------------------------------------
    async def _create(self) -> str:
        cfg = self.config
        tmpfs_opts = "exec,nosuid,nodev,mode=1777"
        kwargs: dict[str, Any] = dict(
            image=cfg.image,
            command=["sleep", "infinity"],
            detach=True,
            labels={
                LABEL: "1",
                LABEL_OWNER: _owner_tag(),
                LABEL_SESSION: SESSION_ID,
                LABEL_SANDBOX: self.instance_id,
            },
            network_mode="none",
            mem_limit=f"{cfg.memory_mb}m",
            memswap_limit=f"{cfg.memory_mb}m",  # = mem_limit: no swap
            nano_cpus=int(cfg.cpus * 1e9),
            pids_limit=cfg.pids,
            read_only=True,
            tmpfs={
                cfg.workdir: f"size={cfg.workdir_mb}m,{tmpfs_opts}",
                "/tmp": f"size={cfg.tmp_mb}m,{tmpfs_opts}",
            },
            user=cfg.user,
            working_dir=cfg.workdir,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            ipc_mode="private",
            shm_size=f"{cfg.tmp_mb}m",
            environment={"HOME": cfg.workdir, "TMPDIR": "/tmp", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"},
            stop_signal="SIGKILL",
        )
        if cfg.runtime:
            kwargs["runtime"] = cfg.runtime

        def create() -> str:
            container = self._client.containers.run(**kwargs)
            self._containers.add(container.id)  # known to close() even if the awaiting task is gone
            return container.id

        fut = asyncio.get_running_loop().run_in_executor(self._executor, create)
        try:
            cid = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The caller gave up; the container will still exist: hand it to the pool once it does.
            fut.add_done_callback(self._adopt)
            raise
        except Exception as err:
            raise SandboxError(f"could not start a sandbox container: {err}") from err
        self.stats["created"] += 1
        if self._closed:  # closed while we were creating it
            await self._destroy(cid)
            raise SandboxError("sandbox is closed")
        return cid

    def _adopt(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        self.stats["created"] += 1
        if self._closed:
            self._spawn(self._destroy(fut.result()))
        else:
            self._idle.put_nowait(fut.result())

    async def _destroy(self, cid: str) -> None:
        import docker

        try:
            await self._call(self._client.api.remove_container, cid, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as err:
            if "already in progress" not in str(err):
                log.warning("could not remove sandbox container %s: %s", cid[:12], err)
                return  # keep it in _containers so close()/the reaper tries again
        self._containers.discard(cid)

    async def _acquire(self) -> str:
        try:
            return self._idle.get_nowait()
        except asyncio.QueueEmpty:
            pass
        # A slot is held, so fewer than max_containers are busy: create one unless one frees up first.
        return await self._create()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _release(self, cid: str, healthy: bool) -> None:
        """Return a container to the pool after scrubbing it, or replace it when it may be broken."""
        try:
            await self._recycle(cid, healthy)
        finally:
            self._slots.release()

    async def _recycle(self, cid: str, healthy: bool) -> None:
        if healthy and not self._closed:
            try:
                healthy = await self._scrub(cid)
            except Exception as err:
                log.debug("scrub of %s failed: %s", cid[:12], err)
                healthy = False
        if healthy and not self._closed:
            self.stats["scrubbed"] += 1
            self._idle.put_nowait(cid)
            return
        self.stats["recycled"] += 1
        await self._destroy(cid)
        if not self._closed and self._idle.qsize() < self.config.pool_size:
            try:
                self._idle.put_nowait(await self._create())
            except SandboxError as err:
                log.warning("could not replenish the sandbox pool: %s", err)

    async def _scrub(self, cid: str) -> bool:
        """Kill every leftover process of the run and empty the writable dirs; False if that failed."""
        wd = self.config.workdir
        script = (
            "kill -9 -1 2>/dev/null; "  # every process of the sandbox user except pid 1 and this shell
            f"rm -rf {wd}/* {wd}/.[!.]* {wd}/..?* /tmp/* /tmp/.[!.]* /tmp/..?* /dev/shm/* 2>/dev/null; "
            f'[ -z "$(ls -A {wd})" ] && [ -z "$(ls -A /tmp)" ]'
        )
        api = self._client.api
        ex = await self._call(api.exec_create, cid, ["sh", "-c", script], user=self.config.user)
        await self._call(api.exec_start, ex["Id"])
        info = await self._call(api.exec_inspect, ex["Id"])
        return info.get("ExitCode") == 0

    # ---- runs -----------------------------------------------------------------------------------
    async def _run(self, command: list[str], files: dict[str, bytes], timeout: float) -> ExecResult:
        if not self._started:
            await self.start()
        if self._closed:
            raise SandboxError("sandbox is closed")
        argv = command
        if files:
            payload = json.dumps(
                {"f": {n: base64.b64encode(c).decode() for n, c in files.items()}, "a": command}
            )
            blob = base64.b64encode(payload.encode()).decode()
            if len(blob) > _MAX_PAYLOAD:
                raise SandboxError(
                    f"files too large for one run ({len(blob)} bytes encoded, max {_MAX_PAYLOAD})"
                )
            argv = [self.config.python, "-c", _BOOT] + [
                blob[i : i + _ARG_CHUNK] for i in range(0, len(blob), _ARG_CHUNK)
            ]
        # The slot is held until the container is scrubbed or replaced (in _release), so at most
        # max_containers containers exist at any time.
        await self._slots.acquire()
        try:
            cid = await self._acquire()
        except BaseException:
            self._slots.release()
            raise
        healthy = False
        try:
            result = await self._exec(cid, argv, timeout)
            healthy = not result.timed_out and result.killed_reason is None
            return result
        except asyncio.CancelledError:
            raise  # the caller gave up: the container may still be running the code, so it is replaced
        except Exception as err:
            raise SandboxError(f"docker exec failed: {type(err).__name__}: {err}") from err
        finally:
            self._spawn(self._release(cid, healthy))

    async def _exec(self, cid: str, argv: list[str], timeout: float) -> ExecResult:
        api = self._client.api
        t0 = time.monotonic()
        ex = await self._call(api.exec_create, cid, argv, user=self.config.user, workdir=self.config.workdir)
        out, err = OutputCap(self.config.max_output_bytes), OutputCap(self.config.max_output_bytes)

        def drain() -> None:
            for o, e in api.exec_start(ex["Id"], stream=True, demux=True):
                if o:
                    out.feed(o)
                if e:
                    err.feed(e)

        fut = asyncio.get_running_loop().run_in_executor(self._executor, drain)
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            timed_out = True
        except asyncio.CancelledError:
            await self._kill(cid)
            raise
        if timed_out:
            await self._kill(cid)  # closes the exec stream, which ends drain()
            try:
                await asyncio.wait_for(asyncio.shield(fut), 10)
            except (TimeoutError, Exception):
                pass
            return ExecResult(out.text(), err.text(), None, True, "timeout", time.monotonic() - t0)
        fut.result()
        info = await self._call(api.exec_inspect, ex["Id"])
        code = info.get("ExitCode")
        duration = time.monotonic() - t0
        reason = signal_reason(code)
        # 137: SIGKILL; 126: Docker could not exec (e.g. "cannot exec in a stopped container"). Either
        # can mean the container itself died under the run, which is the sandbox's fault, not the code's.
        if code in (126, 137) and await self._stops_within(cid, 1.0):
            reason = "sandbox_error: the container was killed from outside"
        return ExecResult(out.text(), err.text(), code, False, reason, duration)

    async def _stops_within(self, cid: str, seconds: float) -> bool:
        """True if the container is (or within ``seconds`` becomes) not running: a SIGKILL that came with
        a container kill, whose state Docker may report as running for a moment after the exec ended."""
        deadline = time.monotonic() + seconds
        while True:
            if not await self._running(cid):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)

    async def _running(self, cid: str) -> bool:
        try:
            state = await self._call(self._client.api.inspect_container, cid)
            return bool(state["State"]["Running"])
        except Exception:
            return False

    async def _kill(self, cid: str) -> None:
        import docker

        try:
            await self._call(self._client.api.kill, cid)
        except (docker.errors.NotFound, docker.errors.APIError):
            pass
