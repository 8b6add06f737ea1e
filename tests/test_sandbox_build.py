"""The image builder's mirror discovery and idempotence, and the sandbox helpers around the backends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_fixtures import IMAGE, need_docker

from agentrl.sandboxes import ExecResult, ProcessSandbox, SandboxError, make_sandbox
from agentrl.sandboxes.base import OutputCap, check_files, signal_reason
from agentrl.sandboxes.build_image import system_mirror


def test_system_mirror_reads_deb822_and_one_line_sources(tmp_path: Path):
    (tmp_path / "sources.list.d").mkdir()
    assert system_mirror("bookworm", tmp_path) is None
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/debian\nSuites: bookworm bookworm-updates\nComponents: "
        "main\n\nTypes: deb\nURIs: http://mirror.invalid/debian-security\nSuites: bookworm-security\n"
    )
    assert system_mirror("bookworm", tmp_path) == "http://mirror.invalid/debian"
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb [arch=amd64] http://other.invalid/debian bookworm main\n"
    )
    assert system_mirror("bookworm", tmp_path) == "http://other.invalid/debian"
    assert system_mirror("trixie", tmp_path) is None


@pytest.mark.docker
def test_build_image_is_a_no_op_when_the_tag_exists():
    need_docker()
    p = subprocess.run(
        [sys.executable, "-m", "agentrl.sandboxes.build_image", "--tag", IMAGE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and "nothing to do" in p.stdout + p.stderr


def test_helpers():
    cap = OutputCap(5)
    cap.feed(b"abc")
    cap.feed(b"defgh")
    assert cap.text() == "abcde\n[... truncated 3 bytes ...]\n"
    assert check_files({"a/b.txt": "x"}) == {"a/b.txt": b"x"}
    for bad in ["/etc/passwd", "../x", "a/../../x", ""]:
        with pytest.raises(SandboxError):
            check_files({bad: "x"})
    assert signal_reason(137) == "memory" and signal_reason(152) == "cpu" and signal_reason(1) is None
    r = ExecResult("out", "err", 2)
    assert not r.ok and r.as_text() == "out\n[stderr]\nerr\n[exit code 2]"
    assert ExecResult("", "", None, True, "timeout", 3.0).as_text() == "[killed: timeout after 3.0s]"
    assert isinstance(make_sandbox("process"), ProcessSandbox)
    with pytest.raises(SandboxError, match="unknown sandbox backend"):
        make_sandbox("vm")


async def test_closed_sandbox_refuses_runs():
    sb = ProcessSandbox()
    await sb.close()
    with pytest.raises(SandboxError, match="closed"):
        await sb.run("print(1)")


async def test_process_file_size_limit():
    async with ProcessSandbox(workdir_mb=1) as sb:
        r = await sb.run("open('big', 'wb').write(b'x' * (2 * 2**20))")
        assert r.exit_code != 0 and ("File too large" in r.stderr or r.killed_reason == "file_size"), r
