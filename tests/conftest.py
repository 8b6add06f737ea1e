"""Shared fixtures: tiny HF model directories built once per test session (the same code path as a real
checkpoint), and the Docker requirement switch (AGENTRL_REQUIRE_DOCKER=1 turns skips into failures).

Temp files: the session gets a temp dir of its own (``TMPDIR``, inherited by every process a test
starts: servers, engines, Ray workers, ``train_async.py``; removed when pytest exits), and a test that
leaves anything in it fails (:func:`_no_temp_leftovers`), so a leak is found even while other jobs share
the machine's temp dir.
pytest's ``tmp_path`` and Ray's session files stay in the machine's temp dir (``PYTEST_DEBUG_TEMPROOT``,
``RAY_TMPDIR``). Ray workers run at normal priority (``RAY_worker_niceness``) and none start ahead of need
(:data:`agentrl.cluster.NO_PRESTART_ENV`), also for the tests that call ``ray.init`` themselves (see
:func:`agentrl.cluster.start_ray`). OpenMP's idle threads sleep instead of
spinning (``OMP_WAIT_POLICY=PASSIVE``): the suite runs more torch processes than there are cores.

GPUs: ``@pytest.mark.gpus(N)`` says a test needs N distinct GPUs; it skips, saying so, where fewer are
visible (``gpus(2, at_least=1)``: it wants two and runs its one-GPU variant on one). Under
scripts/gpu_test.sh (pytest-xdist, ``AGENTRL_TEST_GPUS``) each worker is pinned to GPUs of its own through
``CUDA_VISIBLE_DEVICES`` before anything touches CUDA, a module's tests that share a module-scoped fixture
(a server, a converted model) stay on one worker, and the units that need N > 1 GPUs go to a worker that
holds N (tests/_xdist_gpus.py); ``AGENTRL_TEST_PHASE`` (``one``/``many``) keeps the tests needing one GPU or
those wanting more, for the script's two runs. Every test process runs with SGLang's NCCL setting
(:data:`agentrl.weight_sync.SGLANG_PEER_ENV`): NCCL reads it once per process, at its first communicator, so
a test that meets an SGLang server in a weight-update group cannot set it itself once an earlier test in
the process has used NCCL.
"""

from __future__ import annotations

import getpass
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentrl.testing.gpus import TEST_GPUS_ENV, TEST_PHASE_ENV, gpus_of_worker, parse_layout

pytest_plugins = ["_cpu_durations"]  # --cpu-durations N

# OpenMP threads that finish a parallel region wait for the next one asleep, not spinning: the suite keeps
# more torch processes busy than the machine has cores, and a spinning thread waits for a partner the OS
# has descheduled. On 2 vCPU with two busy processes beside it, the speculative-rollout bench took 160 s
# and 158 CPU-s spinning, 36 s and 27 CPU-s without (libgomp reads this when torch loads it: set before
# anything imports torch, and inherited by every process the tests start)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_LAYOUT = parse_layout(os.environ.get(TEST_GPUS_ENV, ""))  # each worker's GPUs (scripts/gpu_test.sh)
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _LAYOUT and _WORKER:  # before torch is imported, let alone CUDA initialized
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus_of_worker(_WORKER, _LAYOUT))

from agentrl.cluster import NO_PRESTART_ENV  # noqa: E402
from agentrl.models.tiny import build_tiny_model  # noqa: E402
from agentrl.testing.processes import pid_alive  # noqa: E402
from agentrl.weight_sync import SGLANG_PEER_ENV  # noqa: E402

for _key, _value in SGLANG_PEER_ENV.items():  # before any test's first NCCL communicator
    os.environ.setdefault(_key, _value)

# a pytest-xdist worker inherits the controller's TMPDIR (its session dir): the machine's temp dir is the
# one the controller handed on for tmp_path (short paths matter: SGLang puts its IPC sockets in TMPDIR)
_SYSTEM_TMP = (_WORKER and os.environ.get("PYTEST_DEBUG_TEMPROOT")) or tempfile.gettempdir()
_PREFIX = "pytest-agentrl-"
SESSION_TMP = Path(_SYSTEM_TMP)  # the session's own temp dir, made in pytest_configure
_KEPT = (f"torchinductor_{getpass.getuser()}",)  # torch's compile cache, not a leak
# wandb makes these scratch dirs when it is imported (megatron-core imports it when installed) and removes
# them when the process exits
_KEPT_SUFFIXES = ("wandb-media", "wandb-artifacts")
_REPORTED: set[str] = set()  # leftovers a test already failed for


def pytest_configure(config: pytest.Config) -> None:
    """The session's temp dir, named by its pid; those of sessions that were killed are removed."""
    global SESSION_TMP
    for old in Path(_SYSTEM_TMP).glob(f"{_PREFIX}*"):
        pid = old.name[len(_PREFIX) :].split("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    SESSION_TMP = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=_SYSTEM_TMP))
    # traversable like the system temp dir: the process sandbox runs commands as another uid in work dirs
    # it makes here (mkdtemp's 0700 would deny that uid its own script)
    SESSION_TMP.chmod(0o711)
    config.addinivalue_line(
        "markers",
        "sglang: runs a real SGLang server (GPU); skips when SGLang is not installed, fails when it is but "
        "does not work",
    )
    config.addinivalue_line(
        "markers", "xdist_group(name): pytest-xdist's: with --dist loadgroup the group's tests share a worker"
    )
    config.addinivalue_line(
        "markers",
        "gpus(n, at_least=n): needs n distinct GPUs (at_least: runs, in a smaller variant, on that many); "
        "skips with the reason where fewer are visible",
    )
    os.environ["TMPDIR"] = str(SESSION_TMP)
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", _SYSTEM_TMP)  # tmp_path stays pytest's, where it was
    # a parallel worker's Ray keeps its own record of "the machine's latest cluster" and session files
    os.environ.setdefault("RAY_TMPDIR", _SYSTEM_TMP)
    if _WORKER:  # (the controller set the variable for every worker)
        os.environ["RAY_TMPDIR"] = f"{os.environ['RAY_TMPDIR']}/ray_{_WORKER}"
        Path(os.environ["RAY_TMPDIR"]).mkdir(exist_ok=True)
    os.environ.setdefault("RAY_worker_niceness", "0")
    for _name, _value in NO_PRESTART_ENV.items():
        os.environ.setdefault(_name, _value)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(SESSION_TMP, ignore_errors=True)  # also when no test ran


def _gpus_needed(item: pytest.Item) -> tuple[int, int]:
    """(GPUs wanted, GPUs at least) of a test from its ``gpus`` mark; (1, 1) without one."""
    mark = item.get_closest_marker("gpus")
    if mark is None:
        return 1, 1
    want = int(mark.args[0]) if mark.args else int(mark.kwargs["n"])
    return want, int(mark.kwargs.get("at_least", want))


def _shares_module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture set up once for its module (or class, or package) and kept."""
    defs = getattr(item, "_fixtureinfo", None)
    if defs is None:
        return False
    return any(
        d.scope in ("module", "class", "package") for fds in defs.name2fixturedefs.values() for d in fds[-1:]
    )


def _split_group(nodeid: str) -> tuple[str, str]:
    """``tests/f.py::t[a]@grp`` -> (``tests/f.py::t[a]``, ``grp``); no group: (nodeid, "")."""
    at = nodeid.rfind("@")
    return (nodeid[:at], nodeid[at + 1 :]) if at > nodeid.rfind("]") else (nodeid, "")


def _keep_phase(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``AGENTRL_TEST_PHASE`` (scripts/gpu_test.sh runs the suite in two phases): ``one`` keeps the
    tests needing one GPU, ``many`` those wanting more; the others are deselected (the other run has them)."""
    phase = os.environ.get(TEST_PHASE_ENV, "")
    if phase not in ("one", "many"):
        if phase:
            raise pytest.UsageError(f"{TEST_PHASE_ENV}={phase!r}: expected one, many or nothing")
        return
    keep = [(_gpus_needed(i)[0] > 1) == (phase == "many") for i in items]
    if not all(keep):
        config.hook.pytest_deselected(items=[i for i, k in zip(items, keep, strict=True) if not k])
        items[:] = [i for i, k in zip(items, keep, strict=True) if k]


@pytest.hookimpl(trylast=True)  # after pytest-xdist has put each test's xdist_group into its node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of this run's phase (:func:`_keep_phase`); under ``--dist loadgroup``: a module's tests that
    share a module-scoped fixture form one group (an explicit ``xdist_group`` wins), and a group whose tests
    need N > 1 GPUs is named ``...~gpusN`` for the scheduler (tests/_xdist_gpus.py)."""
    _keep_phase(config, items)
    if not _WORKER or not getattr(config.option, "loadgroup", False):  # a worker of --dist loadgroup
        return
    groups: dict[pytest.Item, str] = {}
    need: dict[str, int] = {}
    for item in items:
        base, explicit = _split_group(item.nodeid)
        group = explicit or (base.split("::")[0] if _shares_module_fixture(item) else "")
        group = group or (base if _gpus_needed(item)[0] > 1 else "")
        if group:
            groups[item] = group
            need[group] = max(need.get(group, 1), _gpus_needed(item)[0])
    for item, group in groups.items():
        suffix = f"~gpus{need[group]}" if need[group] > 1 else ""
        item._nodeid = f"{_split_group(item.nodeid)[0]}@{group}{suffix}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    at_least = _gpus_needed(item)[1]
    if at_least > 1:
        have = _visible_gpus()
        if have < at_least:
            pytest.skip(f"needs {at_least} GPUs; {have} visible")


def _visible_gpus() -> int:
    """The GPUs this process sees: a pinned worker's own (conftest's import set them), else CUDA's count."""
    if _LAYOUT and _WORKER:
        return len(gpus_of_worker(_WORKER, _LAYOUT))
    import torch

    return torch.cuda.device_count()


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Units go to the workers holding the GPUs they need (scripts/gpu_test.sh)."""
    if not _LAYOUT or getattr(config.option, "dist", "no") != "loadgroup":
        return None
    from _xdist_gpus import GpuGroupScheduling

    return GpuGroupScheduling(config, log, _LAYOUT)


def _temp_entries() -> set[str]:
    return {
        p.name for p in SESSION_TMP.iterdir() if p.name not in _KEPT and not p.name.endswith(_KEPT_SUFFIXES)
    }


@pytest.fixture(autouse=True)
def _no_temp_leftovers() -> Iterator[None]:
    """Fail a test that leaves a file or directory in the temp dir (servers' scratch dirs, bench dirs,
    logs); what module and session fixtures leave is checked once at the end of the session."""
    before = _temp_entries()
    yield
    left = sorted(_temp_entries() - before)
    if left:
        _REPORTED.update(left)
        pytest.fail(f"the test left {left} in the temp dir {SESSION_TMP}")


@pytest.fixture(autouse=True)
def _ray_current_cluster_kept() -> Iterator[None]:
    """A test that starts nodes with ``ray start`` leaves Ray's record of the machine's latest cluster
    (``<RAY_TMPDIR>/ray/ray_current_cluster``, written by a worker node) as it found it: a later bare
    ``ray.init()`` of another test would join that cluster, or fail to reach it once it is stopped."""
    record = Path(os.environ.get("RAY_TMPDIR", _SYSTEM_TMP)) / "ray" / "ray_current_cluster"
    before = record.read_bytes() if record.is_file() else None
    yield
    if before is None:
        record.unlink(missing_ok=True)
    elif not record.is_file() or record.read_bytes() != before:
        record.write_bytes(before)


@pytest.fixture(scope="session", autouse=True)
def _temp_dir_clean_at_exit() -> Iterator[None]:
    yield
    left = sorted(_temp_entries() - _REPORTED)
    if left:
        pytest.fail(f"the test session left {left} in the temp dir {SESSION_TMP}")


_CACHE: dict[tuple, Path] = {}


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_model_factory(arch="qwen3", hidden_size=32)`` -> a cached HF model dir for that shape."""

    def make(arch: str = "qwen2", seed: int = 0, **shape) -> Path:
        key = (arch, seed, tuple(sorted(shape.items())))
        if key not in _CACHE:
            out = tmp_path_factory.mktemp(f"tiny_{arch}")
            _CACHE[key] = build_tiny_model(out, arch=arch, seed=seed, **shape)
        return _CACHE[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """The default tiny model: Qwen2 family, fp32, 2 layers, hidden 64, GQA 4/2 heads."""
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def search_r1_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bootstrap cache dir (``{cache}`` of :data:`agentrl.testing.configs.TINY_SEARCH_R1`) that every
    run of the session shares. Its entries (world, tiny model, SFT warm start, retrieval index) are keyed by
    their config, so the first run builds them through the job's own bootstrap and the others reuse them."""
    return tmp_path_factory.mktemp("search_r1_cache")


@pytest.fixture(scope="session")
def sglang_required() -> None:
    """Skip, with the reason, where SGLang is not installed (:func:`agentrl.engine.launcher.sglang_installed`:
    its own directory from scripts/gpu_setup.sh --sglang, or this Python). Where it is, a test that cannot
    start or use it fails."""
    from agentrl.engine.launcher import sglang_installed

    if not sglang_installed():
        pytest.skip("SGLang is not installed (scripts/gpu_setup.sh --sglang, or pip install -e '.[sglang]')")


def docker_required() -> bool:
    """CI sets AGENTRL_REQUIRE_DOCKER=1: then a missing Docker engine is a failure, not a skip."""
    return os.environ.get("AGENTRL_REQUIRE_DOCKER", "") not in ("", "0", "false")


@pytest.fixture(scope="session")
def chromium() -> str:
    """The Chromium executable of the browser tests. Missing, the tests skip, except under ``CI=true`` or
    AGENTRL_REQUIRE_CHROMIUM=1 (scripts/test.sh sets it once it installed Debian's chromium): then they
    fail."""
    from agentrl.testing.browser import chromium_path

    path = chromium_path()
    if path is None:
        required = any(
            os.environ.get(k, "") not in ("", "0", "false") for k in ("AGENTRL_REQUIRE_CHROMIUM", "CI")
        )
        msg = "no chromium executable (apt-get install chromium)"
        if required:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture(scope="module")
def megatron_single_rank() -> Iterator[None]:
    """A one-rank gloo world with megatron's parallel_state, for a module's tests that build megatron models
    in process (torn down after the module, unless a trainer in the module has ended it already)."""
    import warnings

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from agentrl.trainer.mcore_compat import apply_cpu_patches

    warnings.filterwarnings("ignore")
    apply_cpu_patches()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
