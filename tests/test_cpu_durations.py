"""The suite's ``--cpu-durations`` meter (tests/_cpu_durations.py) counts the CPU of the processes a test
starts, not only its own, and not what ran before it; the per-worker lines say when each worker ran."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
from _cpu_durations import _Meter, worker_lines

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_the_meter_counts_a_child_process_and_nothing_before_it() -> None:
    before = subprocess.Popen([sys.executable, "-c", BUSY.format(s=0.6) + "time.sleep(60)"])
    spent = psutil.Process(before.pid)
    while sum(spent.cpu_times()[:2]) < 0.6:  # its CPU is spent before the meter starts
        time.sleep(0.05)
    meter = _Meter()
    meter.start()
    subprocess.run([sys.executable, "-c", BUSY.format(s=1.0) + "time.sleep(2)"], check=True)
    seconds = meter.stop()
    before.kill()
    before.wait()
    # the child's busy second (and its interpreter's start), not the earlier process's 0.6 s
    assert 1.0 <= seconds < 1.6, seconds


def test_worker_lines_say_when_each_worker_ran_and_how_long_it_waited_at_the_end() -> None:
    spans = {"gw1": [100.0, 160.0, 50.0], "gw0": [101.0, 190.0, 85.5]}
    assert worker_lines(spans) == [
        "gw0: tests from 1 s to 90 s, 86 s in them, 0 s before the end",
        "gw1: tests from 0 s to 60 s, 50 s in them, 30 s before the end",
    ]
    assert worker_lines({}) == []
