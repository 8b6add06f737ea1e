"""SGLang launcher: the command line it builds from config, and the process lifecycle (health wait,
fail-fast, stop without orphans, SIGKILL escalation, Ray actor) against tests/fixtures/fake_sglang.py,
a stand-in for SGLang (SGLang itself cannot be installed on these machines; tests/test_gpu_sglang.py runs
the real one)."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from agentrl.config import ConfigError, build_config
from agentrl.engine.launcher import (
    ServerStartError,
    SGLangConfig,
    SGLangLauncher,
    SGLangRouterConfig,
    SGLangRouterLauncher,
    remote_sglang_server,
    sglang_args_from_cli,
    sglang_installed,
    sglang_site,
)
from agentrl.testing.processes import pid_alive

STAND_IN = Path(__file__).parent / "fixtures" / "fake_sglang.py"


def _wait_dead(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    """An executable that acts as ``python`` for ``-m sglang.launch_server`` by running the stand-in."""
    wrapper = tmp_path / "python-with-fake-sglang"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STAND_IN}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "FAKE_SGLANG_RECORD": str(tmp_path / "argv.json"),
        "FAKE_SGLANG_CHILD_PID": str(tmp_path / "child.pid"),
        **extra,
    }


def test_command_line_from_config() -> None:
    cfg = SGLangConfig(
        model_path="/models/qwen",
        tp_size=2,
        mem_fraction_static=0.8,
        port=31000,
        api_key="k",
        python="/venv/bin/python",
        extra_args={
            "context-length": 4096,
            "enable_metrics": True,
            "disable-radix-cache": False,
            "json-model-override-args": {"rope_scaling": None},
            "cuda-graph-bs": [1, 2, 4],
        },
    )
    flags = (
        "/venv/bin/python -m sglang.launch_server --model-path /models/qwen --host 127.0.0.1 --port 31000"
        " --tp-size 2 --mem-fraction-static 0.8 --api-key k --attention-backend triton"
        " --sampling-backend pytorch --context-length 4096 --enable-metrics"
    ).split()
    overrides = ["--json-model-override-args", '{"rope_scaling": null}']
    assert SGLangLauncher(cfg).command() == [*flags, *overrides, "--cuda-graph-bs", "1", "2", "4"]
    minimal = (
        "py -m sglang.launch_server --model-path m --host 127.0.0.1 --port 30000 --tp-size 1"
        " --attention-backend triton --sampling-backend pytorch"
    ).split()
    assert SGLangLauncher(SGLangConfig(model_path="m", python="py")).command() == minimal
    with pytest.raises(ValueError, match="duplicate"):
        SGLangLauncher(SGLangConfig(model_path="m", extra_args={"tp-size": 4})).command()
    # one of agentrl's own flags in extra_args too: said once, as extra_args says it
    both = SGLangConfig(
        model_path="m",
        memory_saver=True,
        extra_args={"enable_memory_saver": True, "attention-backend": "fa3"},
    )
    cmd = SGLangLauncher(both).command()
    assert cmd.count("--enable-memory-saver") == 1 and cmd.count("--attention-backend") == 1
    assert cmd[cmd.index("--attention-backend") + 1] == "fa3"


def test_colocated_and_deterministic_flags(tmp_path: Path) -> None:
    cfg = SGLangConfig(
        model_path="m",
        python="py",
        memory_saver=True,
        weights_cpu_backup=True,
        deterministic=True,
        attention_backend=None,
        sampling_backend=None,
        skip_tokenizer_init=True,
    )
    assert SGLangLauncher(cfg).command()[11:] == [
        "--skip-tokenizer-init",
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--enable-deterministic-inference",
    ]


def test_tokenizer_init_skipped_only_without_a_tokenizer(tmp_path: Path) -> None:
    """Auto: a model directory without tokenizer files gets --skip-tokenizer-init (token ids only); one with
    them keeps its tokenizer, which SGLang needs to match stop strings."""
    bare, full = tmp_path / "bare", tmp_path / "full"
    bare.mkdir()
    full.mkdir()
    (full / "tokenizer.json").write_text("{}")
    assert "--skip-tokenizer-init" in SGLangLauncher(SGLangConfig(model_path=str(bare))).command()
    assert "--skip-tokenizer-init" not in SGLangLauncher(SGLangConfig(model_path=str(full))).command()
    forced = SGLangConfig(model_path=str(full), skip_tokenizer_init=True)
    assert "--skip-tokenizer-init" in SGLangLauncher(forced).command()


def test_sglang_site_goes_on_the_servers_pythonpath_only(tmp_path: Path, monkeypatch) -> None:
    """SGLang installed apart (scripts/gpu_setup.sh --sglang) reaches the server's PYTHONPATH, first; a
    named directory without sglang in it is an error; CUDA_HOME comes from nvcc when unset."""
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("AGENTRL_SGLANG_SITE", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    assert sglang_site() is None
    env = SGLangLauncher(SGLangConfig(model_path="m", site_dir=str(site))).environment()
    assert env["PYTHONPATH"] == f"{site}{os.pathsep}/inherited"
    monkeypatch.setenv("AGENTRL_SGLANG_SITE", str(site))
    assert sglang_site() == site and sglang_installed()
    monkeypatch.setenv("AGENTRL_SGLANG_SITE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no sglang package"):
        SGLangLauncher(SGLangConfig(model_path="m")).environment()
    monkeypatch.delenv("AGENTRL_SGLANG_SITE")
    default = tmp_path / "cache" / "sglang"
    (default / "sglang").mkdir(parents=True)
    assert sglang_site() == default  # where gpu_setup.sh --sglang installs by default
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("PATH", f"{nvcc.parent}{os.pathsep}{os.environ['PATH']}")
    assert SGLangLauncher(SGLangConfig(model_path="m")).environment()["CUDA_HOME"] == str(tmp_path / "cuda")


def test_sglang_cli_passthrough() -> None:
    extra, rest = sglang_args_from_cli(
        [
            "run.yaml",
            "--sglang-context-length",
            "8192",
            "--sglang-enable-metrics",
            "--sglang-dp-size=2",
            "x=1",
        ]
    )
    assert extra == {"context-length": "8192", "enable-metrics": True, "dp-size": "2"}
    assert rest == ["run.yaml", "x=1"]
    cmd = SGLangLauncher(SGLangConfig(model_path="m", python="py", extra_args=extra)).command()
    assert cmd[-5:] == ["--context-length", "8192", "--enable-metrics", "--dp-size", "2"]


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="tp_size"):
        build_config(SGLangConfig, {"model_path": "m", "tp_size": 0})
    with pytest.raises(ConfigError, match="unknown field"):
        build_config(SGLangConfig, {"model_path": "m", "tp": 2})
    with pytest.raises(ConfigError, match="not loopback"):
        build_config(SGLangConfig, {"model_path": "m", "host": "0.0.0.0"})
    assert (
        build_config(SGLangConfig, {"model_path": "m", "host": "0.0.0.0", "api_key": "s"}).host == "0.0.0.0"
    )
    with pytest.raises(ConfigError, match="not loopback"):
        build_config(SGLangRouterConfig, {"worker_urls": ["http://127.0.0.1:1"], "host": "10.0.0.1"})


def test_lifecycle_start_health_stop_without_orphans(tmp_path: Path, fake_python: str) -> None:
    cfg = SGLangConfig(
        model_path="/models/m",
        port=0,
        python=fake_python,
        env=_env(tmp_path, FAKE_SGLANG_HEALTH_DELAY="0.5", FAKE_SGLANG_MARKER="seen"),
        log_file=str(tmp_path / "sglang.log"),
        startup_timeout=60,
    )
    launcher = SGLangLauncher(cfg)
    t0 = time.monotonic()
    with launcher:
        assert time.monotonic() - t0 >= 0.5  # waited through the 503s
        assert launcher.healthy()
        recorded = json.loads((tmp_path / "argv.json").read_text())
        assert recorded["argv"] == launcher.command()[1:]  # exactly what was built, port resolved
        assert recorded["env_marker"] == "seen"
        assert recorded["original_logprob"] == "1"  # raw-model logprobs, like the embedded engine
        assert launcher.port != 0 and launcher.url == f"http://127.0.0.1:{launcher.port}"
        leader = launcher.process.pid
        child = int((tmp_path / "child.pid").read_text())
        assert pid_alive(leader) and pid_alive(child)
    assert _wait_dead(leader) and _wait_dead(child), "stop() left processes behind"
    assert not launcher.healthy()


def test_stop_escalates_to_sigkill(tmp_path: Path, fake_python: str) -> None:
    cfg = SGLangConfig(
        model_path="m",
        port=0,
        python=fake_python,
        env=_env(tmp_path, FAKE_SGLANG_IGNORE_TERM="1"),
        stop_grace=0.5,
        startup_timeout=60,
    )
    launcher = SGLangLauncher(cfg).start()
    leader, child = launcher.process.pid, int((tmp_path / "child.pid").read_text())
    scratch = launcher.log_file.parent  # no log_file given: a temp dir of the launcher's own
    assert scratch.name.startswith("agentrl-sglang-") and scratch.is_dir()
    t0 = time.monotonic()
    launcher.stop()
    assert time.monotonic() - t0 < 5
    assert _wait_dead(leader) and _wait_dead(child)
    assert not scratch.exists(), "stop() left its temp dir behind"


def test_fails_fast_with_log_tail_when_server_exits(tmp_path: Path, fake_python: str) -> None:
    cfg = SGLangConfig(model_path="m", port=0, python=fake_python, env=_env(tmp_path, FAKE_SGLANG_EXIT="3"))
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match="simulated startup failure") as info:
        SGLangLauncher(cfg).start()
    assert "code 3" in str(info.value)
    assert time.monotonic() - t0 < 30  # not the 900 s startup timeout


def test_a_port_taken_before_the_server_binds_it_is_replaced(
    tmp_path: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``port: 0``: the port found free is taken by someone else before the server binds it. The server
    exits saying so and starts again on another port; the first attempt leaves no process behind."""
    import socket

    from agentrl.cluster import free_port
    from agentrl.engine import launcher as launcher_module

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        offered = iter([taken])
        monkeypatch.setattr(launcher_module, "free_port", lambda host: next(offered, None) or free_port(host))
        cfg = SGLangConfig(model_path="m", port=0, python=fake_python, env=_env(tmp_path), startup_timeout=60)
        with SGLangLauncher(cfg) as launcher:
            assert launcher.healthy() and launcher.port not in (0, taken)

    # a port set in the config is the user's: it is not swapped for another
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        cfg = SGLangConfig(
            model_path="m", port=squatter.getsockname()[1], python=fake_python, env=_env(tmp_path)
        )
        with pytest.raises(ServerStartError, match=r"(?i)address already in use"):
            SGLangLauncher(cfg).start()


def test_health_timeout_stops_the_server(tmp_path: Path, fake_python: str) -> None:
    cfg = SGLangConfig(
        model_path="m",
        port=0,
        python=fake_python,
        env=_env(tmp_path, FAKE_SGLANG_HEALTH_DELAY="600"),
        startup_timeout=1.5,
    )
    launcher = SGLangLauncher(cfg)
    with pytest.raises(ServerStartError, match="not healthy"):
        launcher.start()
    child = int((tmp_path / "child.pid").read_text())
    assert _wait_dead(launcher.process.pid) and _wait_dead(child)
    assert not launcher.log_file.parent.exists()  # the temp dir goes with a failed start too


def test_router_launcher(tmp_path: Path, fake_python: str) -> None:
    cfg = SGLangRouterConfig(
        worker_urls=["http://127.0.0.1:30001", "http://127.0.0.1:30002"],
        port=0,
        policy="round_robin",
        python=fake_python,
        env=_env(tmp_path),
        extra_args={"request-timeout-secs": 600},
    )
    with SGLangRouterLauncher(cfg) as router:
        argv = json.loads((tmp_path / "argv.json").read_text())["argv"]
        assert (
            argv
            == (
                "-m sglang_router.launch_router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002"
                f" --host 127.0.0.1 --port {router.port} --policy round_robin --request-timeout-secs 600"
            ).split()
        )
        assert router.healthy()
        child = int((tmp_path / "child.pid").read_text())
    assert _wait_dead(child)


@pytest.mark.slow
def test_ray_actor_runs_and_stops_the_server(tmp_path: Path, fake_python: str) -> None:
    import ray

    ray.init(num_cpus=1, num_gpus=0, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        cfg = SGLangConfig(model_path="m", port=0, python=fake_python, env=_env(tmp_path), startup_timeout=60)
        actor = remote_sglang_server(cfg, num_gpus=0)
        url = ray.get(actor.start.remote(), timeout=120)
        assert url.startswith("http://127.0.0.1:")
        assert ray.get(actor.healthy.remote())
        leader = ray.get(actor.pid.remote())
        child = int((tmp_path / "child.pid").read_text())
        assert pid_alive(leader) and pid_alive(child)
        ray.get(actor.stop.remote())
        assert _wait_dead(leader) and _wait_dead(child)
    finally:
        ray.shutdown()
