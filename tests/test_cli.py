"""The ``agentrl`` command: ``agentrl train`` is ``python train_async.py``; the working directory's modules
import in the driver and in every Ray worker; bad names and misspelled fields fail at load, in one line,
with the nearest known name, before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agentrl.cli import config_module_names, list_names, main, put_cwd_on_path
from agentrl.cluster import user_code_env
from agentrl.config import ConfigError
from agentrl.recipe import load_run_config
from agentrl.registry import did_you_mean
from agentrl.run_checks import check_names

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "search_r1" / "config.yaml"

USER_ENV = textwrap.dedent(
    '''
    """A user's env module, next to the config, imported by name."""
    from agentrl.envs import Env, StepResult


    class UnitEnv(Env):
        verifier = "exact_match"

        async def reset(self, task):
            return [{"role": "user", "content": task["prompt"]}]

        async def step(self, action_text):
            return StepResult(None, terminated=True)
    '''
)


def _job(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [["-m", "agentrl.cli", "train"], [str(ROOT / "train_async.py")]])
def test_unknown_env_fails_in_one_line_before_anything_starts(tmp_path: Path, command: list[str]) -> None:
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = _job(
        [sys.executable, *command, "--config", str(DEMO), "env.name=serch", f"output_dir={out}"], tmp_path
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "env.name: unknown env 'serch'; did you mean 'search'? known envs: math, python, search, tool "
        "(or use 'module:attr')"
    ], proc.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    assert not out.exists() and not (tmp_path / ".cache").exists()  # no output, no bootstrap


def test_misspelled_field_and_verifier_name_the_nearest_known(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.lrr: unknown field \(got 3\); did you mean 'lr'\?"):
        load_run_config(DEMO, ["trainer.lrr=3"])
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.temprature: .*did you mean 'temperature'\?"):
        load_run_config(DEMO, ["rollout.sampling.temprature=1"])
    cfg = load_run_config(DEMO, ["rollout.verifier=exact_mtch"])
    with pytest.raises(
        ConfigError, match=r"^rollout\.verifier: unknown verifier 'exact_mtch'; did you mean "
    ):
        check_names(cfg)
    cfg = load_run_config(DEMO, ["env.name=tool", "env.kwargs={tools: [python, {serch: {url: x}}]}"])
    with pytest.raises(
        ConfigError, match=r"^env\.kwargs\.tools\[1\]: unknown tool 'serch'; did you mean 'search'"
    ):
        check_names(cfg)
    cfg = load_run_config(DEMO, ["env.name=no_such_module_here:UnitEnv"])
    with pytest.raises(ConfigError, match=r"env\.name: cannot load env .*working directory or on PYTHONPATH"):
        check_names(cfg)
    cfg = load_run_config(DEMO, ["env.name=agentrl.envs.search:SerchEnv"])
    with pytest.raises(ConfigError, match=r"has no attribute 'SerchEnv'; did you mean 'SearchEnv'\?$"):
        check_names(cfg)
    check_names(load_run_config(DEMO))  # the demo's names resolve
    assert did_you_mean("nope", ["search", "math"]) == ""


def test_the_working_directory_names_user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "unit_env.py").write_text(USER_ENV)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    put_cwd_on_path()
    assert sys.path[0] == str(tmp_path)
    cfg = load_run_config(DEMO, ["env.name=unit_env:UnitEnv", "rollout.verifier=null"])
    check_names(cfg)  # imports ./unit_env.py; its verifier attribute resolves
    assert config_module_names(cfg) == [
        "agentrl.examples.search_r1.recipe:SearchR1Recipe",
        "unit_env:UnitEnv",
    ]
    local = user_code_env(config_module_names(cfg))
    assert local == {"env_vars": {"PYTHONPATH": f"{tmp_path}{os.pathsep}${{PYTHONPATH}}"}}
    cluster = user_code_env(config_module_names(cfg), upload=True)  # agentrl itself is never uploaded
    assert cluster["py_modules"] == [str(tmp_path / "unit_env.py")]


def test_a_ray_worker_on_another_host_imports_the_user_module(tmp_path: Path) -> None:
    """What the run hands Ray on a cluster: a worker imports ./unit_env.py even where the driver's files are
    not (here: the file is moved away once Ray has started, as on a host that does not share them). The
    local instance starts no idle workers ahead of need."""
    (tmp_path / "unit_env.py").write_text(USER_ENV)
    code = textwrap.dedent(
        """
        import os
        import time
        import psutil
        import ray
        from agentrl.cluster import NO_PRESTART_ENV, start_ray, user_code_env

        @ray.remote
        def where():
            import unit_env
            return unit_env.__file__

        for name in NO_PRESTART_ENV:
            os.environ.pop(name, None)  # the suite's own setting (tests/conftest.py): start_ray's here
        start_ray(num_cpus=1, runtime_env=user_code_env(["unit_env:UnitEnv"], upload=True))
        os.rename("unit_env.py", "elsewhere.txt")
        time.sleep(3)  # where Ray prestarts idle workers, they would have started by now
        mine = psutil.Process().children(recursive=True)
        print("IDLE WORKERS", sum(p.name().startswith("ray::IDLE") for p in mine))
        try:
            print("IMPORTED", ray.get(where.remote(), timeout=120))
        finally:
            ray.shutdown()
        """
    )
    proc = _job([sys.executable, "-c", code], tmp_path, timeout=300)
    assert "IMPORTED" in proc.stdout, proc.stderr[-3000:]
    assert "IDLE WORKERS 0" in proc.stdout, proc.stdout[-3000:]
    assert "py_modules" in proc.stdout and str(tmp_path) not in proc.stdout  # Ray's copy, not the file


def test_help_of_both_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    via_cli = _job([sys.executable, "-m", "agentrl.cli", "train", "--help"], ROOT)
    via_script = _job([sys.executable, "train_async.py", "--help"], ROOT)
    assert via_cli.returncode == via_script.returncode == 0
    assert via_cli.stdout.startswith("usage: agentrl train [-h] [--config CONFIG]")
    # the same job: after the usage lines (aligned under the program's name), the same text
    assert via_cli.stdout.split("\n\n", 1)[1] == via_script.stdout.split("\n\n", 1)[1]
    assert "--resume" in via_cli.stdout and "example configs" in via_cli.stdout  # the job's own help
    # every example's config, in its folder: the custom tool env's and the scale recipe's among them
    for config in ("examples/custom_tool_env/config.yaml", "examples/scale/config_7b.yaml"):
        assert f"  {config}\n" in via_cli.stdout
    assert "first on sys.path" in via_cli.stdout and "agentrl list" in via_cli.stdout  # and the command's
    with pytest.raises(SystemExit):
        main([])  # the command's own help
    top = capsys.readouterr().out
    assert "agentrl train --help" in top and "working" in top and "Ray worker" in top
    with pytest.raises(SystemExit):
        main(["trian"])
    assert "unknown command 'trian'; did you mean 'train'?" in capsys.readouterr().err
    assert "tools (env.kwargs.tools): python, search" in list_names()


FLAKY_ENV = textwrap.dedent(
    '''
    """A user's module beside the config: an env that fails on some tasks, a verifier with parts."""
    from agentrl.envs import Env, StepResult
    from agentrl.rewards import RewardResult


    class FlakyEnv(Env):
        async def reset(self, task):
            if task["task_id"] in ("q3", "q7"):
                raise ValueError(f"unknown unit in task {task['task_id']}")
            return [{"role": "user", "content": task["prompt"]}]

        async def step(self, action_text):
            return StepResult(None, terminated=True)


    async def partial(trajectory, label):
        text = trajectory.final_answer or ""
        parts = {"wrote_digit": float(any(c.isdigit() for c in text))}
        return RewardResult(float(label in text), parts=parts)
    '''
)


@pytest.mark.slow
def test_a_run_by_path_imports_the_working_directory_and_shows_failures(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``python <checkout>/train_async.py`` run in the user's directory: its env module imports in the
    driver and the workers, the first env error is on the console with its count, the progress line shows
    the training reward of each step, the verifier's parts are logged and the failed episodes dumped."""
    import json

    from agentrl.metrics import read_metrics

    (tmp_path / "flaky_env.py").write_text(FLAKY_ENV)
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"task_id": f"q{i}", "prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(10)]
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:8]) + "\n")
    (data / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows[8:]) + "\n")
    (tmp_path / "run.yaml").write_text(
        textwrap.dedent(
            f"""
            output_dir: {tmp_path / "run"}
            steps: 2
            model_path: {tiny_model_dir}
            data: {{path: {data}}}
            env: {{name: flaky_env:FlakyEnv}}
            engine: {{max_batch_size: 8}}
            rollout: {{group_size: 2, batch_size: 2, max_concurrency: 8, max_turns: 1, max_total_tokens: 256,
                      verifier: flaky_env:partial, max_retries: 0, filter_zero_variance: false, dump: all,
                      sampling: {{temperature: 1.0, max_new_tokens: 8}},
                      eval_sampling: {{temperature: 0.0, max_new_tokens: 8}}}}
            trainer: {{device: cpu, lr: 1.0e-4, micro_batch_size: 4}}
            ray: {{num_cpus: 2}}
            """
        )
    )
    proc = _job([sys.executable, str(ROOT / "train_async.py"), "--config", "run.yaml"], tmp_path, 600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    err = proc.stderr
    assert err.count("env failure(s) so far; the first: env: ValueError: unknown unit in task q") == 1, err
    steps = [line for line in err.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("train_reward=" in s and "held-out@0 reward=" in s for s in steps), err
    logged = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "batch/reward" in r]
    assert len(logged) == 2 and all("reward/wrote_digit" in r for r in logged)
    # the failed training episodes are in the episode dumps, marked, with their error
    from agentrl.episodes import iter_steps

    failed = [r for _, records in iter_steps(tmp_path / "run") for r in records if r["kind"] == "failed"]
    assert failed and all(r["status"] == "failed" and "unknown unit" in r["error"] for r in failed)


def test_sft_command_is_the_warm_start(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["sft", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: agentrl sft") and "--demos" in out
    with pytest.raises(SystemExit) as exit_:
        main(["sft"])  # the required flags are named
    assert exit_.value.code == 2
    assert "--demos" in capsys.readouterr().err
