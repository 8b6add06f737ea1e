"""200 sandbox runs with injected faults, mostly concurrent, on both backends: afterwards zero containers
and zero processes are left behind, and the pool keeps serving correct results throughout."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
import uuid

import pytest
from sandbox_fixtures import BACKENDS, IMAGE, make_backend

from agentrl.sandboxes import SandboxError
from agentrl.sandboxes.docker import (
    LABEL,
    LABEL_OWNER,
    LABEL_SESSION,
    SESSION_ID,
    _owner_tag,
    reap_containers,
)

pytestmark = pytest.mark.timeout(300)
N_RUNS = 200


def _faults(marker: str) -> dict[str, tuple[str, float]]:
    """name -> (code, timeout)."""
    return {
        "ok": ("print('ok')", 10),
        "exception": ("raise RuntimeError('injected')", 10),
        "exit": ("import sys; sys.exit(7)", 10),
        "selfkill": ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 10),
        "timeout": ("import time; time.sleep(60)", 0.5),
        "detach": (
            "import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)  # {marker}'],"
            " start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\nprint('ok')",
            10,
        ),
        "children": (
            "import subprocess\nfor _ in range(5): "
            f"subprocess.Popen(['sleep', '300', '{marker}'])\nprint('ok')",
            10,
        ),
        "flood": ("import sys; sys.stdout.write('y' * 2_000_000)", 10),
        "memory": ("x = bytearray(2**30)", 10),
    }


def _marker_procs(marker: str) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(int(entry.name))
            except OSError:
                pass
    return out


def _session_containers() -> list[str]:
    out = subprocess.run(
        [
            "docker",
            "ps",
            "-aq",
            "--filter",
            f"label={LABEL}=1",
            "--filter",
            f"label=agentrl.session={SESSION_ID}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def _uid_procs(uids: range) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid in uids:
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


@pytest.mark.parametrize("backend", BACKENDS)
async def test_200_faulty_runs_leave_nothing_behind(backend):
    marker = f"agentrl-fault-{uuid.uuid4().hex}"
    faults = _faults(marker)
    rng = random.Random(0)
    kinds = [rng.choice(list(faults)) for _ in range(N_RUNS)]
    # the process backend on uids of its own, below the default range (uid_base 61000, 4096 uids) that other
    # sandboxes of the host lease from, so that the leak check below sees only this test's runs
    uids = {"uid_base": 60000, "uid_count": 8} if backend == "process" else {}
    sb = make_backend(
        backend,
        pool_size=4,
        max_containers=8,
        max_concurrency=8,
        memory_mb=256,
        max_output_bytes=10_000,
        **uids,
    )
    counts = {"cancelled": 0, "ok": 0, "external_kill": 0}
    dirs_before = {p for p in os.listdir("/tmp") if p.startswith("agentrl-sbx-")}
    t0 = time.monotonic()

    async def one(i: int, kind: str):
        code, timeout = faults[kind]
        task = asyncio.ensure_future(sb.run(code, timeout=timeout))
        if i % 17 == 0:  # the caller gives up mid-run (an aborted episode)
            await asyncio.sleep(0.05)
            task.cancel()
            counts["cancelled"] += 1
            return kind, None
        if backend == "docker" and i % 23 == 0:  # the container dies under the run (engine-side fault)
            await asyncio.sleep(1.0 + (i % 5) * 0.5)  # let the run get under way
            deadline = time.monotonic() + 120  # a pool slow to start (a loaded machine) is waited for
            while not sb._containers and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            ids = list(sb._containers)
            if ids:
                await asyncio.to_thread(
                    subprocess.run, ["docker", "kill", rng.choice(ids)], capture_output=True
                )
                counts["external_kill"] += 1
        try:
            return kind, await task
        except SandboxError:
            return kind, "sandbox_error"

    results = await asyncio.gather(*(one(i, k) for i, k in enumerate(kinds)), return_exceptions=True)
    elapsed = time.monotonic() - t0
    unexpected = [r for r in results if isinstance(r, BaseException)]
    assert not unexpected, unexpected[:3]
    for kind, r in results:
        if r is None or r == "sandbox_error":
            continue
        if kind == "ok" and r.exit_code == 0:
            assert r.stdout == "ok\n", r
            counts["ok"] += 1
        elif r.killed_reason and r.killed_reason.startswith("sandbox_error"):
            assert backend == "docker" and counts["external_kill"]  # only the injected docker kill does this
        elif kind == "timeout":
            assert r.timed_out, r
        elif kind == "exception" and r.exit_code is not None and r.exit_code != 137:
            assert r.exit_code == 1 and "injected" in r.stderr, r
        elif kind == "memory" and r.exit_code not in (None, 137):
            assert r.killed_reason == "memory", r
    assert counts["ok"] > 0
    if backend == "docker":
        assert counts["external_kill"] > 0
    # the pool still serves correct results after all that
    assert (await sb.run("print('after')")).stdout == "after\n"
    await sb.close()
    await asyncio.sleep(0.2)
    assert _marker_procs(marker) == [], "processes leaked"
    if backend == "docker":
        assert _session_containers() == [], "containers leaked"
        assert sb.stats["recycled"] > 0 and sb.stats["scrubbed"] > 0
    else:
        assert _uid_procs(range(sb.config.uid_base, sb.config.uid_base + 8)) == [], "processes leaked"
        assert {p for p in os.listdir("/tmp") if p.startswith("agentrl-sbx-")} <= dirs_before, (
            "work dirs leaked"
        )
    print(f"{backend}: {N_RUNS} runs in {elapsed:.1f}s, {counts}", file=sys.stderr)


@pytest.mark.docker
async def test_reaper_removes_containers_of_dead_owners():
    """A process that dies without cleanup (SIGKILL) leaves containers; the next sandbox start reaps them."""
    make_backend("docker")  # skip/fail early when Docker is not usable
    code = (
        "import asyncio, os, signal\n"
        "from agentrl.sandboxes import DockerSandbox\n"
        "async def main():\n"
        "    sb = DockerSandbox(pool_size=2)\n"
        "    await sb.run('print(1)')\n"
        "    from agentrl.sandboxes.docker import SESSION_ID\n"
        "    print('started', SESSION_ID, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "asyncio.run(main())\n"
    )
    p = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert "started" in p.stdout, p.stderr
    session = p.stdout.split()[-1]

    def left() -> list[str]:
        return subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=agentrl.session={session}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()

    orphans = left()
    assert len(orphans) >= 2, "the killed process should have left its containers behind"
    await asyncio.to_thread(reap_containers)
    # another test process starting a sandbox reaps dead owners too and may take some of them first
    # (what a call counts is what it removed itself: the next test); none is left either way
    assert left() == []


def _remove_and_close(client, containers) -> None:
    """Remove the containers a test made (a reaper may have removed them already) and close its client."""
    import docker

    for c in containers:
        try:
            c.remove(force=True)
        except docker.errors.NotFound:
            pass
    client.close()


@pytest.mark.docker
def test_the_reaper_counts_the_containers_it_removed():
    """Containers of one session, owned by this live process (no other reaper touches them)."""
    import docker

    make_backend("docker")
    client = docker.from_env(timeout=30)
    session = f"count-{os.getpid()}-{time.monotonic_ns()}"
    labels = {LABEL: "1", LABEL_OWNER: _owner_tag(), LABEL_SESSION: session}
    made = [client.containers.create(IMAGE, "true", labels=labels) for _ in range(3)]
    try:
        assert reap_containers(client, session=session, dead_owners=False) == 3
        assert reap_containers(client, session=session, dead_owners=False) == 0
    finally:
        _remove_and_close(client, made)


@pytest.mark.docker
def test_a_container_removed_while_the_reaper_lists_them_is_no_error():
    """Another process closes its sandbox (its containers removed) while a reaper lists the host's
    containers: the reaper goes on and removes the dead owner's container all the same."""
    import docker

    make_backend("docker")
    client = docker.from_env(timeout=30)
    made = []
    try:
        for owner in (_owner_tag(), "{host}:999999999:0"):
            labels = {LABEL: "1", LABEL_OWNER: owner.format(host=os.uname().nodename), LABEL_SESSION: "other"}
            made.append(client.containers.create(IMAGE, "true", labels=labels))
        live, dead = made
        listing = client.api.containers

        def listing_then_removal(*args, **kwargs):
            out = listing(*args, **kwargs)
            live.remove(force=True)  # gone between the listing and whatever the reaper reads per container
            return out

        client.api.containers = listing_then_removal
        reap_containers(client)
        client.api.containers = listing
        # sparse, as the reaper lists: other processes' sandboxes come and go meanwhile
        left = {c.id for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"}, sparse=True)}
    finally:
        _remove_and_close(client, made)
    # the dead owner's container is gone: this reaper's doing, or a concurrent test process's
    assert dead.id not in left


@pytest.mark.docker
async def test_exit_reaper_removes_containers_when_close_is_forgotten():
    make_backend("docker")
    code = (
        "import asyncio\n"
        "from agentrl.sandboxes import DockerSandbox\n"
        "from agentrl.sandboxes.docker import SESSION_ID\n"
        "async def main():\n"
        "    sb = DockerSandbox(pool_size=2)\n"
        "    await sb.run('print(1)')\n"
        "    print(SESSION_ID, flush=True)\n"  # no close(): the atexit reaper must clean up
        "asyncio.run(main())\n"
    )
    p = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    session = p.stdout.split()[-1]
    left = subprocess.run(  # noqa: ASYNC221 - a quick CLI query after the run
        ["docker", "ps", "-aq", "--filter", f"label=agentrl.session={session}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert p.returncode == 0, p.stderr
    assert left == []


def test_a_run_cancelled_while_its_sandbox_starts_kills_the_whole_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run cancelled after the isolation tool was forked but before its start returned (a window a
    loaded host widens; here the start is held open for a second) kills the tool's whole process group,
    not the tool's pid alone. The tool here is a stand-in whose child outlives a kill of its parent's pid,
    as bwrap's namespace init does when bwrap dies before the init has armed its parent-death signal."""
    from agentrl.sandboxes import process as module

    marker = f"agentrl-cancelled-start-{uuid.uuid4().hex}"
    child = f"{sys.executable} -c 'import time; time.sleep(300)' {marker}"
    real_start = asyncio.create_subprocess_exec
    running = asyncio.Event()

    async def slow_start(*argv: str, **kwargs: object) -> asyncio.subprocess.Process:
        proc = await real_start(*argv, **kwargs)
        deadline = time.monotonic() + 30
        while not _marker_procs(marker) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        running.set()
        await asyncio.sleep(1.0)  # the start returns a second later
        return proc

    async def scenario() -> list[int]:
        sandbox = make_backend("process")
        monkeypatch.setattr(sandbox, "_argv", lambda *_: (["sh", "-c", f"{child} & wait"], None))
        monkeypatch.setattr(module.asyncio, "create_subprocess_exec", slow_start)
        run = asyncio.create_task(sandbox.run("print('never runs')"))
        await running.wait()
        alive = _marker_procs(marker)
        run.cancel()  # while the start is still held open
        with pytest.raises(asyncio.CancelledError):
            await run
        await sandbox.close()
        return alive

    alive = asyncio.run(scenario())
    assert alive, "the stand-in's child should have been running when the run was cancelled"
    deadline = time.monotonic() + 10
    while _marker_procs(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _marker_procs(marker)
    for pid in left:  # leave nothing behind, even when the assertion fails
        os.kill(pid, 9)
    assert left == [], "a process of the cancelled run outlived it"
