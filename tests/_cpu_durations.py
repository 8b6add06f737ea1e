"""``--cpu-durations N``: the N tests that used the most CPU time, beside pytest's ``--durations``.

The suite is CPU-bound on a small machine (two workers on two cores), where a test's wall time says more
about what ran beside it than about the test. A test's CPU time here is its worker process's own (user
and system) plus that of every process below it while the test runs (servers, jobs, a run's Ray
processes and workers), from its setup to the end of its teardown. The processes below are sampled
every 0.2 s, so a process's last fraction of a second before it exits, and one that lives less than
that, may be missed; a process started before the test (a module-scoped fixture's server) counts with
what it used during the test. Under pytest-xdist the figures reach the controller with the reports.

It also says when each worker ran tests: its first test's start and last test's end (from the run's
first start) and the seconds its tests took, so a worker left idle at the end (the other still running a
long test) shows.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psutil
import pytest

_METER = pytest.StashKey["_Meter"]()
_PROPERTY = "cpu_s"
_SECONDS: dict[str, float] = {}  # nodeid -> CPU-seconds, where the reports arrive
_SPANS: dict[str, list[float]] = {}  # worker -> [its first start, its last stop, seconds in its tests]
INTERVAL_S = 0.2


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=0,
        metavar="N",
        help="show the N tests that used the most CPU time (their worker's and that of the processes "
        "below it while they ran); 0: none",
    )


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


class _Meter:
    """CPU-seconds of this process and the processes below it, from :meth:`start` to :meth:`stop`."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.base: dict[tuple[int, float], float] = {}  # (pid, start time) -> CPU at the first sample
        self.last: dict[tuple[int, float], float] = {}  # (pid, start time) -> CPU at the last sample
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-durations", daemon=True)

    def start(self) -> None:
        self._sample(first=True)
        self._thread.start()

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        self._sample()
        return sum(cpu - self.base.get(key, 0.0) for key, cpu in self.last.items())

    def _run(self) -> None:
        while not self._done.wait(INTERVAL_S):
            self._sample()

    def _sample(self, first: bool = False) -> None:
        try:
            procs = [self.me, *self.me.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            try:
                key, cpu = (p.pid, p.create_time()), _cpu(p)
            except psutil.Error:
                continue  # gone since the listing
            if first:
                self.base[key] = cpu
            self.last[key] = cpu


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if item.config.getoption("--cpu-durations"):
        meter = item.stash[_METER] = _Meter()
        meter.start()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the teardown report, made after this, carries the figure
    if _METER in item.stash:
        item.user_properties.append((_PROPERTY, item.stash[_METER].stop()))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    gateway = getattr(getattr(report, "node", None), "gateway", None)  # pytest-xdist's worker
    span = _SPANS.setdefault(gateway.id if gateway is not None else "main", [report.start, report.stop, 0.0])
    span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)
    span[2] += report.stop - report.start
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == _PROPERTY:
                _SECONDS[report.nodeid] = float(value)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    n = config.getoption("--cpu-durations")
    if not n or not _SECONDS:
        return
    total = sum(_SECONDS.values())
    terminalreporter.write_sep("=", f"most CPU time: {min(n, len(_SECONDS))} of {len(_SECONDS)} tests")
    for nodeid, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1])[:n]:
        terminalreporter.write_line(f"{seconds:8.1f} CPU-s  {nodeid}")
    terminalreporter.write_line(f"{total:8.0f} CPU-s in all the tests measured")
    for line in worker_lines(_SPANS):
        terminalreporter.write_line(line)


def worker_lines(spans: dict[str, list[float]]) -> list[str]:
    """One line a worker: when it ran tests (seconds from the run's first start) and how long they took."""
    if not spans:
        return []
    t0, end = min(s[0] for s in spans.values()), max(s[1] for s in spans.values())
    return [
        f"{name}: tests from {first - t0:.0f} s to {last - t0:.0f} s, {busy:.0f} s in them, "
        f"{end - last:.0f} s before the end"
        for name, (first, last, busy) in sorted(spans.items())
    ]
