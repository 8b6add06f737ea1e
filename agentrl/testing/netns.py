"""Two hosts on one machine for tests: two Linux network namespaces joined by a veth pair.

Each namespace has its own loopback (up) and one end of the pair, with an address of a private /30 (a
random one of ``10.250.0.0/16``; names carry the test process's pid, so parallel tests never share a
name). Nothing is routed out: a process in one namespace reaches the other's address and its own loopback,
nothing else. That is what a multi-host run needs a test of: two hosts that share no loopback.

:func:`netns_problem` says why namespaces cannot be made here (they need root and ``ip``); tests fail on it
under ``CI=true`` or ``AGENTRL_REQUIRE_NETNS=1`` and skip with the reason elsewhere (:func:`need_netns`).
:class:`TwoHosts` makes the pair and tears everything down, even after a failure: the processes in either
namespace (whoever started them, :meth:`Host.pids`), the namespaces, and with them the veth pair. Pairs
left by a killed test process are removed by the next :class:`TwoHosts` (:func:`reap_stale`).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.testing.processes import pid_alive

PREFIX = "agentrl-ns-"  # every namespace made here: PREFIX<pid of the test process>-<tag>-<a|b>
NETWORK = (10, 250)  # the /16 the pairs' /30s come from


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def netns_problem() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no ip command (apt-get install iproute2)"
    name = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", name)
    except RuntimeError as e:
        return f"cannot make a network namespace: {e}"
    with contextlib.suppress(RuntimeError):
        _ip("netns", "delete", name)
    return None


def netns_required() -> bool:
    """CI (``CI=true``) and ``AGENTRL_REQUIRE_NETNS=1``: a machine without namespaces fails the tests."""
    return any(os.environ.get(k, "") not in ("", "0", "false") for k in ("CI", "AGENTRL_REQUIRE_NETNS"))


def need_netns() -> None:
    """Skip the calling test, with the reason, when namespaces cannot be made; fail instead under CI."""
    import pytest

    problem = netns_problem()
    if problem:
        if netns_required():
            pytest.fail(f"the two-host tests need network namespaces, but {problem}")
        pytest.skip(f"{problem} (CI fails here instead of skipping)")


@dataclass
class Host:
    """One namespace: its name, its address on the pair, and how to run commands in it."""

    name: str
    address: str

    def command(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside this namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``cmd`` inside this namespace."""
        return subprocess.run(self.command(cmd), **kwargs)

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen`` of ``cmd`` inside this namespace, in a session of its own (a signal to its
        group reaches what it started)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.command(cmd), **kwargs)

    def pids(self) -> list[int]:
        """Every process in this namespace now."""
        proc = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=30)
        return [int(p) for p in proc.stdout.split() if p.isdigit()]

    def stop_processes(self, timeout: float = 20.0) -> list[int]:
        """SIGTERM every process in the namespace, then SIGKILL what is left after ``timeout`` s; returns
        the pids that had to be killed."""
        for pid in self.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while (left := self.pids()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:  # a killed process leaves when it is reaped
            time.sleep(0.1)
        return left


def _namespaces() -> list[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _delete(name: str) -> None:
    Host(name, "").stop_processes()
    with contextlib.suppress(RuntimeError):
        _ip("netns", "delete", name)  # the veth end in it goes with it, and so does its peer


def reap_stale() -> list[str]:
    """Delete the namespaces (and their processes) of test processes that no longer run."""
    stale = []
    for name in _namespaces():
        pid = name[len(PREFIX) :].split("-")[0] if name.startswith(PREFIX) else ""
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            _delete(name)
            stale.append(name)
    return stale


class TwoHosts:
    """Namespaces ``a`` and ``b`` joined by a veth pair on a random private /30; a context manager (and
    :meth:`close`) that removes both, with every process in them."""

    def __init__(self) -> None:
        reap_stale()
        taken = set(_namespaces())
        rng = random.Random()
        while True:
            tag = f"{rng.randrange(16**6):06x}"
            names = (f"{PREFIX}{os.getpid()}-{tag}-a", f"{PREFIX}{os.getpid()}-{tag}-b")
            if not taken & set(names):
                break
        third, fourth = rng.randrange(256), rng.randrange(64) * 4  # the /30: .fourth is its network
        net = f"{NETWORK[0]}.{NETWORK[1]}.{third}"
        self.a = Host(names[0], f"{net}.{fourth + 1}")
        self.b = Host(names[1], f"{net}.{fourth + 2}")
        veth = (f"arl{tag}a", f"arl{tag}b")  # names in the root namespace for a moment (15 chars at most)
        try:
            for host in (self.a, self.b):
                _ip("netns", "add", host.name)
            _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
            for host, end in zip((self.a, self.b), veth, strict=True):
                _ip("link", "set", end, "netns", host.name)
                _ip("-n", host.name, "addr", "add", f"{host.address}/30", "dev", end)
                _ip("-n", host.name, "link", "set", end, "up")
                _ip("-n", host.name, "link", "set", "lo", "up")
        except BaseException:
            with contextlib.suppress(RuntimeError):
                _ip("link", "delete", veth[0])  # still in the root namespace when the move failed
            self.close()
            raise

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.a, self.b

    def close(self) -> None:
        """Stop every process in both namespaces and delete them (the veth pair goes with them)."""
        existing = set(_namespaces())
        for host in (self.b, self.a):
            if host.name in existing:
                _delete(host.name)

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
