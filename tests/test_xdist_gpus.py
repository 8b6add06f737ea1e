"""How scripts/gpu_test.sh spreads the GPU suite over a machine's GPUs, checked on the CPU: the GPU count
it finds (a stand-in nvidia-smi, or CUDA_VISIBLE_DEVICES), its pytest runs and their workers' GPUs
(:func:`agentrl.testing.gpus.suite_phases`, :func:`~agentrl.testing.gpus.worker_gpus`), and pytest-xdist
runs of a small suite under tests/conftest.py as the script makes them, with four and one stand-in GPUs:
each worker pinned to its own GPUs, one-GPU tests on every GPU and then the two-GPU tests on pairs, a
module sharing a module-scoped fixture kept on one worker, and a test needing more GPUs than a worker
holds skipped with its reason in the summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.testing.gpus import format_layout, gpus_of_worker, parse_layout, suite_phases, worker_gpus

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_test.sh"


def test_worker_layout_gives_the_first_worker_the_largest_need_and_shares_no_gpu() -> None:
    assert worker_gpus([]) == []
    assert worker_gpus(["0"]) == [["0"]]
    assert worker_gpus(["0", "1"]) == [["0", "1"]]
    assert worker_gpus(["0", "1", "2", "3"]) == [["0", "1"], ["2"], ["3"]]
    assert worker_gpus(["0", "1", "2", "3"], largest=1) == [["0"], ["1"], ["2"], ["3"]]
    assert worker_gpus(["0", "1", "2", "3"], largest=3) == [["0", "1", "2"], ["3"]]
    assert worker_gpus(["0", "1"], largest=4) == [["0", "1"]]  # all there are; the test skips
    eight = worker_gpus([str(i) for i in range(8)])
    assert len(eight) == 7 and sorted(g for w in eight for g in w) == [str(i) for i in range(8)]
    layout = parse_layout(format_layout(worker_gpus(["4", "5", "6", "7"])))
    assert layout == [["4", "5"], ["6"], ["7"]] and gpus_of_worker("gw2", layout) == ["7"]
    with pytest.raises(ValueError, match="has 1"):
        gpus_of_worker("gw1", [["0", "1"]])


def _dry_run(tmp_path: Path, listed: str | None, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if listed is not None:  # a stand-in nvidia-smi printing one index per GPU, as --query-gpu=index does
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\nprintf '{listed}'\n")
        fake.chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    full |= {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", **env}
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "-k", "sglang"], env=full, capture_output=True, text=True
    )


def test_script_finds_the_gpus_and_runs_one_gpu_tests_on_every_gpu_then_pairs(tmp_path: Path) -> None:
    four = _dry_run(tmp_path, "0\\n1\\n2\\n3\\n")
    assert four.returncode == 0, four.stderr
    # the suite's tests need at most two GPUs (test_gpu.py's NCCL sync): one-GPU tests on four workers,
    # then the two-GPU ones on two pairs
    assert "GPUs 0,1,2,3, tests needing one GPU: 4 worker(s), their GPUs 0;1;2;3" in four.stdout
    pytest_cmd = "python -m pytest -m gpu -n {} --dist loadgroup -k sglang"
    cmd = "AGENTRL_TEST_PHASE='one' AGENTRL_TEST_GPUS='0;1;2;3' " + pytest_cmd.format(4)
    assert cmd in four.stdout
    assert "GPUs 0,1,2,3, tests needing more than one GPU: 2 worker(s), their GPUs 0,1;2,3" in four.stdout
    cmd = "AGENTRL_TEST_PHASE='many' AGENTRL_TEST_GPUS='0,1;2,3' " + pytest_cmd.format(2)
    assert cmd in four.stdout
    two = _dry_run(tmp_path, "0\\n1\\n")
    assert "their GPUs 0;1\n" in two.stdout and "their GPUs 0,1\n" in two.stdout, two.stdout
    named = _dry_run(tmp_path, "0\\n1\\n2\\n3\\n", CUDA_VISIBLE_DEVICES="3,1")  # the variable wins
    assert "GPUs 3,1, tests needing one GPU: 2 worker(s), their GPUs 3;1" in named.stdout
    one = _dry_run(tmp_path, None, CUDA_VISIBLE_DEVICES="2")
    assert "GPUs 2: 1 worker(s), their GPUs 2" in one.stdout and "AGENTRL_TEST_GPUS='2' " in one.stdout
    assert one.stdout.count("python -m pytest") == 1 and "AGENTRL_TEST_PHASE=''" in one.stdout
    none = _dry_run(tmp_path, "")
    assert none.returncode == 1 and "no GPU found" in none.stderr


def test_suite_phases_split_one_gpu_tests_from_multi_gpu_ones() -> None:
    assert suite_phases([]) == []
    assert suite_phases(["0"]) == [("", [["0"]])]
    assert suite_phases(["0", "1"], largest=1) == [("", [["0"], ["1"]])]
    assert suite_phases(["0", "1"]) == [("one", [["0"], ["1"]]), ("many", [["0", "1"]])]
    assert suite_phases(["0", "1", "2"]) == [("one", [["0"], ["1"], ["2"]]), ("many", [["0", "1"]])]
    four = suite_phases(["4", "5", "6", "7"])
    assert four == [("one", [["4"], ["5"], ["6"], ["7"]]), ("many", [["4", "5"], ["6", "7"]])]
    assert suite_phases(["0", "1"], largest=4) == [("one", [["0"], ["1"]]), ("many", [["0", "1"]])]


SUITE = {
    "test_shared.py": """
import pytest
from record import record

@pytest.fixture(scope="module")
def server():
    return object()

@pytest.mark.parametrize("i", range(4))
def test_uses_the_shared_server(server, i):
    record(f"shared{i}", 1)
""",
    "test_single.py": """
import pytest
from record import record

@pytest.mark.parametrize("i", range(6))
def test_one_gpu(i):
    record(f"single{i}", 1)
""",
    "test_pair.py": """
import pytest
from record import record

@pytest.mark.gpus(2)
def test_two_gpus():
    record("two", 2)

@pytest.mark.gpus(2, at_least=1)
def test_two_or_one():
    record("two_or_one", 1)

@pytest.mark.gpus(3)
def test_three_gpus():
    record("three", 3)
""",
    "record.py": """
import json, os

def record(name, need):
    gpus = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    assert len(gpus) >= need, gpus
    worker = os.environ["PYTEST_XDIST_WORKER"]
    node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]  # "@group" at its end when grouped
    line = {"test": name, "worker": worker, "gpus": gpus, "node": node}
    line |= {"tmp": os.environ["TMPDIR"], "ray": os.environ["RAY_TMPDIR"]}
    with open(os.environ["LAYOUT_LOG"], "a") as f:
        f.write(json.dumps(line) + "\\n")
""",
}


def _run_suite(
    tmp_path: Path, gpus: str, phase: str, layout: list[list[str]]
) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """One pytest run of the stand-in suite as scripts/gpu_test.sh makes it: ``phase`` and ``layout``."""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (the test extra has it)")
    suite = tmp_path / f"suite_{gpus.replace(',', '')}_{phase or 'all'}"
    suite.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", suite / "conftest.py")
    shutil.copy(ROOT / "tests" / "_xdist_gpus.py", suite / "_xdist_gpus.py")
    for name, text in SUITE.items():
        (suite / name).write_text(text)
    log = suite / "layout.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "PYTEST_XDIST_WORKER")}
    env |= {"AGENTRL_TEST_GPUS": format_layout(layout), "LAYOUT_LOG": str(log), "AGENTRL_TEST_PHASE": phase}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env["RAY_TMPDIR"] = str(suite)  # the workers' Ray dirs go below it
    workers = str(len(layout))
    xdist = ["-n", workers, "--dist", "loadgroup"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            *xdist,
            "-o",
            "addopts=",
            str(suite),
        ],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ran = {}
    if log.exists():
        ran = {r["test"]: r for r in map(json.loads, log.read_text().splitlines())}
    return proc, ran


@pytest.mark.slow
def test_xdist_runs_pin_workers_and_place_tests_by_their_gpus(tmp_path: Path) -> None:
    (one, single), (many, pairs) = suite_phases(["0", "1", "2", "3"])
    proc, ran = _run_suite(tmp_path, "0,1,2,3", one, single)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "10 passed in" in out, out[-2000:]  # the multi-GPU tests wait for the second run
    assert all(r["gpus"] == [r["worker"].removeprefix("gw")] for r in ran.values()), ran
    assert not {"two", "two_or_one", "three"} & set(ran), ran
    assert len({ran[f"shared{i}"]["worker"] for i in range(4)}) == 1  # one module fixture, one worker
    assert len({ran[f"shared{i}"]["node"].split("@")[1] for i in range(4)}) == 1  # as one group
    # the rest stay ungrouped, free to spread over the workers (where they land is the scheduler's timing)
    assert not any("@" in ran[f"single{i}"]["node"] for i in range(6)), ran
    for r in ran.values():  # a temp dir of the worker's own, not inside the controller's, and a Ray dir
        assert not Path(r["tmp"]).parent.name.startswith("pytest-agentrl-"), r
        assert Path(r["ray"]) == tmp_path / "suite_0123_one" / f"ray_{r['worker']}", r

    proc, ran = _run_suite(tmp_path, "0,1,2,3", many, pairs)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "2 passed, 1 skipped in" in out, out[-2000:]
    assert "needs 3 GPUs; 2 visible" in out  # the reason, in the summary
    assert set(ran) == {"two", "two_or_one"}, ran
    assert all(r["gpus"] == {"gw0": ["0", "1"], "gw1": ["2", "3"]}[r["worker"]] for r in ran.values()), ran

    [(everything, layout)] = suite_phases(["0"])
    proc, ran = _run_suite(tmp_path, "0", everything, layout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "11 passed, 2 skipped" in out, out[-2000:]
    assert "needs 2 GPUs; 1 visible" in out and "needs 3 GPUs; 1 visible" in out
    assert ran["two_or_one"]["gpus"] == ["0"] and "two" not in ran


def test_an_unknown_phase_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    env = {**os.environ, "AGENTRL_TEST_PHASE": "some", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 4 and "AGENTRL_TEST_PHASE='some': expected one, many or nothing" in proc.stderr
