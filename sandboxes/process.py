"""ProcessSandbox: isolation without Docker, from Linux namespaces and rlimits.

Each run is a fresh child process tree inside:

* **bubblewrap** (``bwrap``, preferred): new network namespace (loopback only), new pid/ipc/uts
  namespaces, a fresh root in which only system dirs (``/usr``, ``/lib*``, ``/bin``, the Python install,
  a few ``/etc`` files) are bound read-only, private ``/proc``, ``/dev`` and ``/tmp``, a per-run work dir
  as the only writable place, and ``--die-with-parent``;
* else **unshare** (util-linux): new network/pid/ipc/uts namespaces with ``--kill-child``. It hides no
  files: the host filesystem is visible with ordinary permissions. Use it only when bwrap is missing.

Both add rlimits (``RLIMIT_AS`` memory, ``RLIMIT_NPROC`` processes, ``RLIMIT_CPU``, ``RLIMIT_FSIZE``,
no core files). When the host process is root, the code additionally runs as an unprivileged uid with
``no_new_privs`` and an empty capability bounding set (``setpriv``). Each run leases a uid of its own from
``[uid_base, uid_base + uid_count)`` (:class:`UidLease`: an exclusive ``flock`` on one lock file per uid,
so no two live runs share a uid, whether they belong to one sandbox, to two sandboxes of one process or to
two processes of the host); the per-user process limit is per run and runs cannot signal each other. At
the end of a run its process group is killed, the pid namespace dies with it, and as root every process of
the run's uid is killed too, while the lease is still held -- a detached process does not outlive its run,
and no other run's process is ever touched.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import os
import random
import resource
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from .base import SANDBOX_BACKENDS, ExecResult, OutputCap, Sandbox, SandboxConfig, SandboxError, signal_reason

_PR_SET_PDEATHSIG = 1
_ETC_FILES = [
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "localtime",
    "nsswitch.conf",
    "passwd",
    "group",
]


class ProcessSandboxConfig(SandboxConfig):
    """Process backend settings (plus the shared limits of :class:`SandboxConfig`)."""

    isolation: Literal["auto", "bwrap", "unshare"] = Field(
        "auto", description="namespace tool: bwrap when installed (auto), else unshare"
    )
    max_concurrency: int = Field(16, ge=1, description="most runs at once")
    uid_base: int = Field(
        61000, ge=1000, description="as root: each run leases a uid of its own from uid_base on (never root)"
    )
    uid_count: int = Field(
        4096,
        ge=1,
        description="as root: how many uids from uid_base runs lease from, across every sandbox of the host",
    )
    ro_binds: list[str] = Field(default_factory=list, description="extra host paths bound read-only (bwrap)")


def _libc_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


@SANDBOX_BACKENDS.register("process")
class ProcessSandbox(Sandbox):
    """Namespace + rlimit sandbox. ``ProcessSandbox()`` works with defaults on any Linux with bwrap or
    unshare."""

    def __init__(self, config: ProcessSandboxConfig | None = None, **overrides: Any) -> None:
        if config is not None and overrides:
            config = config.model_copy(update=overrides)
        self.config = config or ProcessSandboxConfig(**overrides)
        self.isolation = self._pick_isolation()
        self.as_root = os.geteuid() == 0
        self._free_slots: asyncio.Queue[int] | None = None
        self._running: set[asyncio.subprocess.Process] = set()
        self._closed = False
        self._python = self._resolve_python()

    # ---- setup ----------------------------------------------------------------------------------
    def _pick_isolation(self) -> str:
        want = self.config.isolation
        if want in ("auto", "bwrap") and shutil.which("bwrap"):
            return "bwrap"
        if want == "bwrap":
            raise SandboxError("bubblewrap (bwrap) is not installed; apt-get install bubblewrap")
        if shutil.which("unshare"):
            return "unshare"
        raise SandboxError("neither bwrap nor unshare is available; ProcessSandbox needs one of them")

    def _resolve_python(self) -> str:
        """A bare name is looked up in the system dirs first (PATH may hold shims, e.g. pyenv's scripts)."""
        name = self.config.python
        found = name if os.path.isabs(name) else shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
        found = found or shutil.which(name)
        return os.path.realpath(found) if found else name

    def _ro_paths(self) -> list[str]:
        """Host paths visible (read-only) inside a bwrap sandbox."""
        paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
        paths += [f"/etc/{name}" for name in _ETC_FILES]
        py = Path(self._python)
        if not str(py).startswith("/usr/"):
            # A python outside /usr (pyenv, conda, venv): bind its installation prefix, and for a venv
            # the base installation it points at.
            prefix = py.parent.parent
            paths.append(str(prefix))
            cfg = prefix / "pyvenv.cfg"
            if cfg.is_file():
                for line in cfg.read_text().splitlines():
                    if line.split("=")[0].strip() == "home":
                        paths.append(str(Path(line.split("=", 1)[1].strip()).parent))
        paths += self.config.ro_binds
        return [p for p in dict.fromkeys(paths) if os.path.lexists(p)]

    def _bwrap_argv(self, workdir: str) -> list[str]:
        argv = [
            "bwrap",
            "--die-with-parent",
            "--new-session",
            "--unshare-net",
            "--unshare-pid",
            "--unshare-ipc",
        ]
        argv += ["--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
        for p in self._ro_paths():
            if os.path.islink(p) and os.path.dirname(p) == "/":
                argv += ["--symlink", os.readlink(p), p]  # merged-/usr layouts: /bin -> usr/bin
            else:
                argv += ["--ro-bind", p, p]
        argv += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            "--bind",
            workdir,
            self.config.workdir,
        ]
        argv += ["--chdir", self.config.workdir, "--clearenv"]
        for k, v in self._env().items():
            argv += ["--setenv", k, v]
        if self.as_root:
            # bwrap drops every capability of root unless told otherwise; keep only what setpriv needs.
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        return [*argv, "--"]

    def _unshare_argv(self) -> list[str]:
        argv = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts"]
        if not self.as_root:
            argv += ["--user", "--map-root-user"]
        return [*argv, "--"]

    def _env(self) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.config.workdir,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    def _preexec(self, uid: int | None) -> Any:
        cfg = self.config
        mem = cfg.memory_mb * 1024 * 1024
        fsize = cfg.workdir_mb * 1024 * 1024
        nproc = cfg.pids if uid is not None else _user_procs() + cfg.pids
        cpu = int(cfg.timeout) + 2

        def preexec() -> None:  # runs in the child between fork and exec
            if _PRCTL is not None:
                _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # die with the owning (Python) process
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        return preexec

    # ---- runs -----------------------------------------------------------------------------------
    async def _run(self, command: list[str], files: dict[str, bytes], timeout: float) -> ExecResult:
        if self._closed:
            raise SandboxError("sandbox is closed")
        if self._free_slots is None:
            self._free_slots = asyncio.Queue()
            for i in range(self.config.max_concurrency):
                self._free_slots.put_nowait(i)
        slot = await self._free_slots.get()
        lease: UidLease | None = None
        try:
            if self.as_root:
                lease = await UidLease.acquire(self.config.uid_base, self.config.uid_count)
            return await self._run_as(lease.uid if lease else None, command, files, timeout)
        finally:
            if lease is not None:
                lease.release()
            self._free_slots.put_nowait(slot)

    async def _run_as(
        self, uid: int | None, command: list[str], files: dict[str, bytes], timeout: float
    ) -> ExecResult:
        # Created synchronously so that a cancellation can never leave a work dir nobody removes.
        workdir = tempfile.mkdtemp(prefix="agentrl-sbx-")
        proc: asyncio.subprocess.Process | None = None
        out, err = OutputCap(self.config.max_output_bytes), OutputCap(self.config.max_output_bytes)
        timed_out = False
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(self._fill_workdir, workdir, files, uid)
            argv, inner_cwd = self._argv(workdir, uid, command)
            start = asyncio.ensure_future(
                asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    cwd=inner_cwd,
                    env=self._env() if inner_cwd else None,
                    start_new_session=True,
                    preexec_fn=self._preexec(uid),
                )
            )
            proc = await _started(start, argv[0])
            self._running.add(proc)
            try:
                await asyncio.wait_for(
                    asyncio.gather(_pump(proc.stdout, out), _pump(proc.stderr, err), proc.wait()), timeout
                )
            except TimeoutError:
                timed_out = True
        finally:
            # Always, also on cancellation: kill the group (the pid namespace dies with bwrap), as root
            # every process of the run's uid, then reap and remove the work dir. Synchronous on purpose:
            # these are quick, and an await here could be interrupted by a second cancellation.
            if proc is not None:
                _killpg(proc.pid)
                self._running.discard(proc)
            if uid is not None:
                _kill_uid(uid)
            shutil.rmtree(workdir, ignore_errors=True)
        if proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                pass
        duration = time.monotonic() - t0
        code = proc.returncode
        if code is not None and code < 0:
            code = 128 - code  # shell convention, like Docker and bwrap report it
        if timed_out:
            return ExecResult(out.text(), err.text(), None, True, "timeout", duration)
        stderr = err.text()
        reason = signal_reason(code)
        if reason is None and code not in (0, None) and "MemoryError" in stderr[-2000:]:
            reason = "memory"  # RLIMIT_AS makes allocations fail instead of the OOM killer striking
        if code is not None and code >= 126 and "bwrap:" in stderr[:500] and self.isolation == "bwrap":
            reason = reason or f"sandbox_error: {stderr.strip()[:200]}"
        return ExecResult(out.text(), stderr, code, False, reason, duration)

    def _argv(self, workdir: str, uid: int | None, command: list[str]) -> tuple[list[str], str | None]:
        """The full argv (isolation tool, privilege drop, command) and the host cwd (unshare only)."""
        if command and command[0] == self.config.python:
            command = [self._python, *command[1:]]
        if self.isolation == "bwrap":
            argv, inner_cwd = self._bwrap_argv(workdir), None
        else:
            argv, inner_cwd = self._unshare_argv(), workdir
        if uid is not None:
            argv += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
            argv += ["--inh-caps=-all", "--bounding-set=-all", "--"]
        return argv + command, inner_cwd

    def _fill_workdir(self, path: str, files: dict[str, bytes], uid: int | None) -> None:
        for name, content in files.items():
            dest = os.path.join(path, name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(content)
        if uid is not None:
            for root, dirs, names in os.walk(path):
                for n in [*dirs, *names]:
                    os.chown(os.path.join(root, n), uid, uid)
            os.chown(path, uid, uid)

    async def close(self) -> None:
        """Kill every run still in progress. Idempotent."""
        self._closed = True
        for proc in list(self._running):
            _killpg(proc.pid)


class UidLease:
    """One uid of ``[base, base + count)`` held for one run: an exclusive ``flock`` on that uid's lock file.

    ``flock`` locks belong to an open file, so two leases conflict within one process as well as across
    processes, and the kernel drops a lease whose holder died. A uid found free may still have processes
    left by a holder that died: :meth:`acquire` kills them before handing the uid out.
    """

    POLL_S = 0.02

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd: int | None = fd

    @staticmethod
    def lock_dir() -> str:
        """Where the lock files live: ``AGENTRL_SANDBOX_UID_DIR``, else ``/run`` (root's), else the temp
        dir."""
        path = os.environ.get("AGENTRL_SANDBOX_UID_DIR")
        if not path:
            base = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
            path = os.path.join(base, "agentrl-sandbox-uids")
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    @classmethod
    def try_acquire(cls, base: int, count: int) -> UidLease | None:
        """A free uid of the range, or None when every one is leased (never blocks)."""
        folder = cls.lock_dir()
        start = random.randrange(count)  # spread concurrent callers over the range
        for k in range(count):
            uid = base + (start + k) % count
            fd = os.open(os.path.join(folder, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _kill_uid(uid)  # leftovers of a holder that died; nobody else may use this uid now
            return cls(uid, fd)
        return None

    @classmethod
    async def acquire(cls, base: int, count: int) -> UidLease:
        """A free uid of the range, waiting while every one is leased."""
        while (lease := cls.try_acquire(base, count)) is None:
            await asyncio.sleep(cls.POLL_S)
        return lease

    def release(self) -> None:
        """Give the uid back (idempotent). Call it only after every process of the uid is killed."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


async def _started(
    start: asyncio.Future[asyncio.subprocess.Process], tool: str
) -> asyncio.subprocess.Process:
    """The process ``start`` creates (``tool``: the program, for the error). Its start is never cut
    short: a start cancelled half-way kills the isolation tool by its pid alone, which can leave the pid
    namespace's init it forked behind, outside every later kill. A run cancelled while its process starts
    waits for the start and kills the whole process group; cancelled again, it leaves that kill to the
    start's end."""
    try:
        return await asyncio.shield(start)
    except asyncio.CancelledError:
        try:
            proc = await asyncio.shield(start)
        except asyncio.CancelledError:
            start.add_done_callback(_kill_started)
        except OSError:
            pass
        else:
            _killpg(proc.pid)
        raise
    except OSError as e:
        raise SandboxError(f"could not start {tool}: {e}") from e


def _kill_started(start: asyncio.Future[asyncio.subprocess.Process]) -> None:
    if not start.cancelled() and start.exception() is None:
        _killpg(start.result().pid)


async def _pump(stream: asyncio.StreamReader | None, cap: OutputCap) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        cap.feed(chunk)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _user_procs() -> int:
    uid = os.getuid()
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _kill_uid(uid: int) -> int:
    """SIGKILL every process owned by ``uid`` (the run's private uid); returns how many were signalled."""
    n = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid:
                os.kill(int(entry.name), signal.SIGKILL)
                n += 1
        except (OSError, ProcessLookupError):
            pass
    return n
