"""The run's engine start-up (agentrl.placement) for ``engine.backend: sglang``: each SGLang server is
launched inside a Ray actor (here the labelled SGLang stand-in, tests/fixtures/fake_sglang.py), reported by
URL, and stopped with no process left behind."""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path

import pytest

from agentrl.cluster import stop_all
from agentrl.placement import Fleet
from agentrl.recipe import load_run_config
from agentrl.testing.processes import pid_alive

STAND_IN = Path(__file__).parent / "fixtures" / "fake_sglang.py"


@pytest.mark.slow
def test_sglang_backend_launches_in_ray_actors_and_stops(tmp_path: Path) -> None:
    import ray

    wrapper = tmp_path / "python-with-fake-sglang"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STAND_IN}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    records = [tmp_path / f"record_{i}.json" for i in range(2)]
    cfg = load_run_config(
        None,
        [
            f"output_dir={tmp_path}",
            "model_path=/models/m",
            "data.path=/data",
            "env.name=math",
            "engine.backend=sglang",
            "engine.num_engines=2",
            f"engine.sglang.python={wrapper}",
            "engine.sglang.tp_size=2",
            "engine.sglang.extra_args={context-length: 4096}",
            f"engine.sglang.env={{FAKE_SGLANG_RECORD: {records[0]}}}",
        ],
    )
    assert cfg.engine.sglang is not None and cfg.engine.sglang.model_path == "/models/m"
    fleet = Fleet(cfg)
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)  # fake: 2 engines x tp 2
    try:
        urls = fleet.start_engines("/models/m")
        assert len(urls) == 2 and len(set(urls)) == 2  # two servers, two free ports
        assert all(u.startswith("http://127.0.0.1:") for u in urls)
        rec = json.loads(records[0].read_text())  # the last server started wrote it
        argv = rec["argv"]
        assert argv[:2] == ["-m", "sglang.launch_server"]
        assert argv[argv.index("--model-path") + 1] == "/models/m"
        assert argv[argv.index("--tp-size") + 1] == "2"
        assert argv[argv.index("--context-length") + 1] == "4096"
        assert rec["original_logprob"] == "1"
        pid = rec["pid"]
        assert pid_alive(pid)
    finally:
        stop_all(fleet.services)
        ray.shutdown()
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pid), "the SGLang server outlived its actor"
