"""Process sandboxes never touch each other's processes: as root every live run holds a uid of its own, leased
across sandbox instances and across processes, and a run's end kills only its own uid's processes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap

import pytest

from agentrl.sandboxes import ProcessSandbox, SandboxRunKilled
from agentrl.sandboxes.process import UidLease
from agentrl.tools.python import python_tool

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="uid leases are taken only when the host process is root"),
]

SLEEP_THEN_UID = "import os, time; time.sleep({s}); print(os.getuid())"
# every test here leases from a lock dir of its own (lock_dir), and a lease kills leftovers of its uid: so
# each test takes uids no other sandbox of the host leases while it runs, neither the default range (uid_base
# 61000, 4096 uids) that other test processes lease through the host's lock dir, nor another test's range
# here (pytest-xdist may run two tests of this file at once)
UID_COUNT = 64
CONCURRENT_BASE, CROSS_PROCESS_BASE, LEASE_BASE, KILLED_BASE = 59000, 59100, 59200, 59300


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    path = tmp_path / "uids"
    monkeypatch.setenv("AGENTRL_SANDBOX_UID_DIR", str(path))
    return path


async def test_concurrent_sandboxes_do_not_kill_each_other(lock_dir) -> None:
    # eight separate instances, as when every tool call opens its own sandbox; short runs end while the
    # long ones still sleep, and their end must not kill them
    boxes = [ProcessSandbox(uid_base=CONCURRENT_BASE, uid_count=UID_COUNT) for _ in range(8)]
    try:
        runs = [
            box.run(SLEEP_THEN_UID.format(s=0.2 if i % 2 else 1.5), timeout=30) for i, box in enumerate(boxes)
        ]
        results = await asyncio.gather(*runs)
    finally:
        await asyncio.gather(*(box.close() for box in boxes))
    assert all(r.exit_code == 0 and r.killed_reason is None for r in results), results
    uids = [int(r.stdout) for r in results]
    assert len(set(uids)) == 8 and all(CONCURRENT_BASE <= u < CONCURRENT_BASE + UID_COUNT for u in uids), uids


async def test_uid_leases_are_exclusive_across_processes(lock_dir) -> None:
    # another process of the host holds runs of its own while this one runs: no uid is shared, no run killed
    other = textwrap.dedent(
        f"""
        import asyncio, json
        from agentrl.sandboxes import ProcessSandbox

        async def main():
            boxes = [ProcessSandbox(uid_base={CROSS_PROCESS_BASE}, uid_count=4) for _ in range(2)]
            res = await asyncio.gather(*(b.run({SLEEP_THEN_UID.format(s=2.0)!r}, timeout=30) for b in boxes))
            print(json.dumps([[r.exit_code, r.stdout.strip()] for r in res]))

        asyncio.run(main())
        """
    )
    env = {**os.environ, "AGENTRL_SANDBOX_UID_DIR": str(lock_dir)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", other, stdout=asyncio.subprocess.PIPE, env=env
    )
    try:
        await asyncio.sleep(1.0)  # the other process's two runs hold two of the four uids now
        boxes = [ProcessSandbox(uid_base=CROSS_PROCESS_BASE, uid_count=4) for _ in range(2)]
        mine = await asyncio.gather(*(b.run(SLEEP_THEN_UID.format(s=0.1), timeout=30) for b in boxes))
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
    theirs = json.loads(out.decode().strip().splitlines()[-1])
    assert [code for code, _ in theirs] == [0, 0], theirs
    assert all(r.exit_code == 0 for r in mine), mine
    assert len({int(u) for _, u in theirs} | {int(r.stdout) for r in mine}) == 4


def test_a_lease_is_held_until_released_and_reused_after(lock_dir) -> None:
    first = UidLease.try_acquire(LEASE_BASE, 2)
    second = UidLease.try_acquire(LEASE_BASE, 2)
    assert first is not None and second is not None and first.uid != second.uid
    assert UidLease.try_acquire(LEASE_BASE, 2) is None  # both taken, in this process too
    first.release()
    first.release()  # idempotent
    third = UidLease.try_acquire(LEASE_BASE, 2)
    assert third is not None and third.uid == first.uid
    second.release()
    third.release()


async def test_a_run_the_sandbox_killed_is_an_error_result(lock_dir) -> None:
    async with ProcessSandbox(uid_base=KILLED_BASE, uid_count=UID_COUNT, memory_mb=128) as box:
        slow = await python_tool(box, timeout=1.0).invoke({"code": "import time; time.sleep(30)"})
        fine = await python_tool(box, timeout=60).invoke({"code": "raise SystemExit(3)"})
    assert slow.is_error and "SandboxRunKilled" in slow.content and "timeout" in slow.content
    assert not fine.is_error and "[exit code 3]" in fine.content
    async with ProcessSandbox(uid_base=KILLED_BASE, uid_count=UID_COUNT) as box:
        stopped = await box.run("import time; time.sleep(5)", timeout=0.5)
    with pytest.raises(SandboxRunKilled):
        stopped.text_or_raise()
