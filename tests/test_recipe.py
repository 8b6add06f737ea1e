"""The recipe hook (agentrl.recipe): the generic loop gets its model, tasks, services, held-out figures and
report from the run's recipe. The contract check names what a recipe lacks; ``recipe`` is read before
the rest of the config, which its config model validates (bad fields named); the default recipe reads
JSONL and parquet tasks; the core imports nothing from the examples; and ``train_async.py`` runs a
non-search env with its verifier through the default recipe, end to end."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from agentrl.config import ConfigError
from agentrl.metrics import read_metrics
from agentrl.recipe import (
    DefaultRecipe,
    Prepared,
    check_recipe,
    load_run_config,
    make_recipe,
    read_tasks,
    resolve_recipe,
    summary_rows,
)
from agentrl.run_config import RunConfig
from agentrl.types import Status, Trajectory

ROOT = Path(__file__).resolve().parent.parent
SEARCH_R1 = "agentrl.examples.search_r1.recipe:SearchR1Recipe"
GENERIC = ["model_path=/m", "data.path=/d", "env.name=math"]


def _traj(reward: float | None, status: Status = Status.COMPLETED, **info: Any) -> Trajectory:
    return Trajectory(task_id="t", group_id="g", prompt_ids=[1], reward=reward, status=status, info=info)


# ---- the contract --------------------------------------------------------------------------------------
def test_the_shipped_recipes_pass_the_contract_check() -> None:
    assert check_recipe(DefaultRecipe) == []
    assert check_recipe(resolve_recipe(SEARCH_R1)) == []
    assert resolve_recipe("default") is DefaultRecipe


def test_the_contract_check_names_what_is_wrong() -> None:
    class NoHooks:
        config: ClassVar[Any] = dict

    problems = check_recipe(NoHooks)
    assert problems[0].startswith("config must be RunConfig or a subclass")
    assert [p.split("(")[0] for p in problems[1:]] == [
        "prepare",
        "start_services",
        "batch_metrics",
        "eval_metrics",
        "finish",
    ]
    instance = DefaultRecipe(load_run_config(None, GENERIC))
    assert check_recipe(instance) == [f"a recipe is a class, got {instance!r}"]


def test_a_bad_recipe_name_fails_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"recipe: unknown recipe 'serch'; known recipes: default"):
        load_run_config(None, [*GENERIC, "recipe=serch"])
    with pytest.raises(
        ConfigError, match=r"recipe: cannot load recipe 'agentrl.recipe:nothing': .* no attribute 'nothing'"
    ):
        load_run_config(None, [*GENERIC, "recipe=agentrl.recipe:nothing"])
    with pytest.raises(ConfigError, match=r"recipe: 'agentrl.recipe:read_tasks': a recipe is a class"):
        load_run_config(None, [*GENERIC, "recipe=agentrl.recipe:read_tasks"])
    with pytest.raises(ConfigError, match=r"recipe: a recipe name or module:Class, got 3"):
        load_run_config(None, [*GENERIC, "recipe=3"])


# ---- config: the recipe's model validates the whole file ----------------------------------------------
def test_the_recipe_picks_the_config_model_and_bad_fields_are_named() -> None:
    demo = load_run_config(ROOT / "examples" / "search_r1" / "config.yaml")
    assert type(demo).__name__ == "SearchR1Config" and demo.bootstrap is not None
    assert type(make_recipe(demo)).__name__ == "SearchR1Recipe"
    generic = load_run_config(None, GENERIC)
    assert type(generic) is RunConfig and isinstance(make_recipe(generic), DefaultRecipe)
    with pytest.raises(ConfigError) as err:
        load_run_config(None, ["data.path=/d", "bootstrap.sft.steps=3", "env.kwargs=3"])
    msg = str(err.value)
    assert "model_path: Field required" in msg
    assert "env.kwargs: Input should be a valid dictionary" in msg
    assert "bootstrap: unknown field" in msg and "need recipe: module:Class" in msg  # the hint
    assert "trainer.model_path" not in msg  # a missing model_path is reported once


def test_a_config_of_another_recipe_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"recipe: .* takes a SearchR1Config, got a RunConfig"):
        run = {"recipe": SEARCH_R1, "model_path": "/m", "data": {"path": "/d"}, "env": {"name": "search"}}
        make_recipe(RunConfig.model_validate(run))


def test_the_core_imports_nothing_from_the_examples() -> None:
    code = (
        "import sys, agentrl.run_config, agentrl.recipe; "
        "bad = [m for m in sys.modules if m.startswith('agentrl.examples')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    for path in [ROOT / "train_async.py", *(ROOT / "agentrl").rglob("*.py")]:
        assert "env.name ==" not in path.read_text(), f"{path} special-cases an env by name"


# ---- the default recipe ---------------------------------------------------------------------------------
def test_default_recipe_reads_jsonl_and_parquet_splits(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "train.jsonl").write_text(
        "\n".join(json.dumps({"prompt": f"{i}+1", "label": i + 1}) for i in range(5))
    )
    pq.write_table(pa.Table.from_pylist([{"prompt": "2+2", "label": "4"}] * 3), tmp_path / "test.parquet")
    cfg = load_run_config(
        None,
        [
            "model_path=/m",
            f"data.path={tmp_path}",
            "env.name=math",
            "data.max_train_tasks=4",
            "eval.num_tasks=2",
        ],
    )
    model_dir, train, held_out = DefaultRecipe(cfg).prepare()
    assert model_dir == "/m"
    assert train == [{"prompt": f"{i}+1", "label": i + 1} for i in range(4)]
    assert held_out == [{"prompt": "2+2", "label": "4"}] * 2
    # one file: training tasks only, no evaluation
    cfg = load_run_config(None, ["model_path=/m", f"data.path={tmp_path / 'train.jsonl'}", "env.name=math"])
    assert DefaultRecipe(cfg).prepare() == Prepared(
        "/m", [{"prompt": f"{i}+1", "label": i + 1} for i in range(5)], []
    )
    cfg = load_run_config(
        None, ["model_path=/m", f"data.path={tmp_path}", "env.name=math", "data.train_split=dev"]
    )
    with pytest.raises(FileNotFoundError, match=r"no dev.jsonl, .jsonl.gz or .parquet \(data.train_split\)"):
        DefaultRecipe(cfg).prepare()


def test_a_bad_task_line_is_named(tmp_path: Path) -> None:
    f = tmp_path / "tasks.jsonl"
    f.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"tasks.jsonl:2: a task must be a JSON object, got list"):
        read_tasks(f)
    f.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"tasks.jsonl:2: not JSON"):
        read_tasks(f)


def test_default_and_search_r1_figures() -> None:
    trajs = [_traj(1.0), _traj(0.5), _traj(None, Status.FAILED), _traj(1.0, num_searches=2)]
    assert DefaultRecipe.eval_metrics(None, trajs) == {"eval/reward": 0.625, "eval/failed": 0.25}  # type: ignore[arg-type]
    search = make_recipe(load_run_config(ROOT / "examples" / "search_r1" / "config.yaml"))
    assert search.eval_metrics(trajs) == {"eval/exact_match": 0.5}
    assert search.batch_metrics(trajs) == {"batch/searches": 0.5}
    assert search.batch_metrics(trajs[:3]) == {}  # an env that counts none


def test_finish_plots_and_prints_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_run_config(None, [*GENERIC, f"output_dir={tmp_path}"])
    history = [
        {"step": 1.0, "batch/reward": 0.2, "batch/response_tokens": 9.0},
        {"step": 2.0, "eval/reward": 0.5},
    ]
    result = {
        "eval_before": {"eval/reward": 0.25},
        "eval_after": {"eval/reward": 0.5},
        "steps": 2,
        "policy_version": 2,
        "wall_s": 3.0,
        "mean_wait_batch_s": 0.5,
        "accounting": {"trained": 4},
    }
    assert (
        DefaultRecipe(cfg).finish(result, history, [(0, {"eval/reward": 0.25}), (2, {"eval/reward": 0.5})])
        == result
    )
    assert (tmp_path / "reward.png").stat().st_size > 1000
    out = capsys.readouterr().out
    for row in (
        r"held-out reward before +0\.250",
        r"held-out reward after +0\.500",
        r"final train reward +0\.200",
        r"tasks trained / dropped +4 / 0",
        rf"outputs +{tmp_path}/ \(reward.png, summary.json\)\n",
    ):
        assert re.search(row, out), (row, out)


def test_the_summary_names_only_the_outputs_written(tmp_path: Path) -> None:
    result = {"steps": 1, "policy_version": 1, "wall_s": 1.0}
    outputs = dict(summary_rows(result, [], tmp_path, "reward.png"))["outputs"]
    assert outputs == f"{tmp_path}/ (summary.json)"  # nothing written yet: no TensorBoard logs claimed
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "tb").mkdir()  # what the TensorBoard writer makes when the package is installed
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "reward.png").write_bytes(b"")
    outputs = dict(summary_rows(result, [], tmp_path, "reward.png"))["outputs"]
    assert outputs == f"{tmp_path}/ (metrics.jsonl, tb/, reward.png, checkpoints/, summary.json)"


# ---- end to end: a non-search env and its verifier through the default recipe -------------------------
@pytest.mark.slow
def test_train_async_runs_any_env_through_the_default_recipe(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"task_id": f"q{i}", "prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(12)]
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:8]) + "\n")
    (data / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows[8:]) + "\n")
    cfg = tmp_path / "math.yaml"
    cfg.write_text(
        f"""
output_dir: {tmp_path / "run"}
steps: 2
model_path: {tiny_model_dir}
data: {{path: {data}}}
env: {{name: math}}
engine: {{max_batch_size: 8}}
rollout: {{group_size: 2, batch_size: 2, max_concurrency: 8, max_turns: 1, max_total_tokens: 256,
          sampling: {{temperature: 1.0, max_new_tokens: 12}},
          eval_sampling: {{temperature: 0.0, max_new_tokens: 12}},
          filter_zero_variance: false}}
trainer: {{device: cpu, lr: 1.0e-4, micro_batch_size: 4}}
ray: {{num_cpus: 2}}
"""
    )
    proc = subprocess.run(
        [sys.executable, "train_async.py", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "4 held-out tasks" in proc.stdout and "held-out reward before RL" in proc.stdout
    out = tmp_path / "run"
    rows_logged = read_metrics(out / "metrics.jsonl")
    assert [r["policy_version"] for r in rows_logged if "policy_version" in r] == [1, 2]
    evals = [r for r in rows_logged if "eval/reward" in r]
    assert len(evals) == 2 and all(r["eval/num_tasks"] == 4 and r["eval/failed"] == 0 for r in evals)
    summary = json.loads((out / "summary.json").read_text())
    assert (
        set(summary["eval_after"]) == {"eval/reward", "eval/failed"} and summary["accounting"]["trained"] >= 4
    )
    assert (out / "reward.png").is_file() and "recipe: default" in (out / "config.yaml").read_text()


# ---- the quick start: openai-SDK agent, base install only ----------------------------------------------
def test_the_quick_start_needs_only_the_base_install() -> None:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"openai\b", d) for d in deps), (
        "examples/openai_agent.py imports openai: a base dependency"
    )


@pytest.mark.slow
def test_the_quick_start_says_it_is_a_smoke_run(tmp_path: Path) -> None:
    """The README's quick start as shown (one step here): it says that its reward is not expected to move,
    shows the token-exact figure it checks, and names the Search-R1 demo."""
    config = ROOT / "examples" / "openai_agent.yaml"
    argv = [
        str(ROOT / "train_async.py"),
        "--config",
        str(config),
        f"output_dir={tmp_path / 'run'}",
        "steps=1",
    ]
    proc = subprocess.run(
        [sys.executable, *argv, "ray.num_cpus=2"],
        cwd=tmp_path,  # the recipe builds its tiny model under ./.cache
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.stdout.count("smoke run: 1 steps of a randomly initialised model") == 2, proc.stdout
    gap = re.search(r"token-exact: max \|engine logprob - trainer logprob\| over the run (\S+) ", proc.stdout)
    assert gap and float(gap.group(1)) < 1e-4, proc.stdout
    assert "RL from a trained warm start on a real task: python train_async.py" in proc.stdout


# ---- --help: where the config is described, the recipes, the example configs ---------------------------
def test_the_help_text_names_the_reference_the_recipes_and_every_example_config() -> None:
    default = ROOT / "examples" / "search_r1" / "config.yaml"
    code = (
        "import sys; from agentrl.recipe import describe_for_help; print(describe_for_help(sys.argv[1])); "
        "bad = [m for m in sys.modules if m.startswith('agentrl.examples')]; assert not bad, bad"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(default)], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr  # and it imported none of the examples
    text = proc.stdout
    assert "description: docs/reference/config.md\n" in text and (ROOT / "docs/reference/config.md").is_file()
    assert "recipes (the config's recipe key): registered default;" in text
    # the top level's, then each example folder's (search_r1, custom_tool_env, scale, ...)
    configs = sorted(ROOT.glob("examples/*.yaml")) + sorted(ROOT.glob("examples/*/*.yaml"))
    assert len(configs) >= 10
    shown = re.findall(r"^  (examples/\S+\.yaml)$", text, re.MULTILINE)
    assert shown == [str(p.relative_to(ROOT)) for p in configs]
    demo = text.split("  examples/search_r1/config.yaml\n")[1].split("\n  examples/")[0]
    assert (
        "(the default config)" in demo and "recipe agentrl.examples.search_r1.recipe:SearchR1Recipe" in demo
    )
    assert text.count("(the default config)") == 1


# ---- the demo's headline: before and after on the same tasks, with standard errors ---------------------
def test_the_gain_is_paired_over_the_tasks_both_evaluations_scored() -> None:
    from agentrl.examples.search_r1.recipe import gain, standard_error

    before = {"a": False, "b": False, "c": True, "d": False}
    after = {"a": True, "b": False, "c": True, "d": True, "e": True}  # e was not scored before: left out
    f = gain(before, after)
    assert (f["eval_tasks"], f["em_before"], f["em_after"], f["em_gain"]) == (4, 0.25, 0.75, 0.5)
    assert f["em_before_se"] == pytest.approx(math.sqrt(0.25 * 0.75 * 4 / 3 / 4))
    assert f["em_gain_se"] == pytest.approx(math.sqrt(1 / 3) / 2)  # differences 1, 0, 0, 1
    # a policy that is right on exactly the tasks it was right on before: gain 0, no spread
    assert gain(before, before)["em_gain"] == 0 and gain(before, before)["em_gain_se"] == 0
    assert standard_error([1.0]) == 0.0


def test_search_r1_finish_prints_the_gain_with_its_standard_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_run_config(
        ROOT / "examples" / "search_r1" / "config.yaml", [f"output_dir={tmp_path}", "pass_at_k=null"]
    )
    recipe = make_recipe(cfg)
    trajs = [_traj(1.0 if i < 2 else 0.0) for i in range(4)]
    for i, t in enumerate(trajs):
        t.task_id = f"t{i}"
    recipe.eval_metrics(trajs)  # before: t0, t1 right
    for t in trajs:
        t.reward = 1.0 if t.task_id != "t3" else 0.0
    recipe.eval_metrics(trajs)  # after: t0, t1, t2 right
    result = {
        "eval_before": {"eval/exact_match": 0.5},
        "eval_after": {"eval/exact_match": 0.75},
        "steps": 2,
        "policy_version": 2,
        "wall_s": 3.0,
        "accounting": {"trained": 4},
    }
    history = [{"step": 1.0, "batch/reward": 0.2, "batch/response_tokens": 9.0}]
    summary = recipe.finish(
        result, history, [(0, {"eval/exact_match": 0.5}), (2, {"eval/exact_match": 0.75})]
    )
    assert (summary["em_before"], summary["em_after"], summary["em_gain"]) == (0.5, 0.75, 0.25)
    out = capsys.readouterr().out
    assert re.search(r"held-out exact match before +0\.500 ± 0\.289 \(greedy, 4 tasks\)", out), out
    assert re.search(r"RL gain over the warm start +\+0\.250 ± 0\.250 \(paired\)", out), out
    assert "RL added +0.250 ± 0.250 held-out exact match over the warm start" in out


def test_the_demo_warm_start_is_weak_at_searching_alone() -> None:
    """The demo's warm start is deliberately weak at one skill, searching: its first action is calibrated
    with one fixed probability below 1/2 (greedy decoding never searches); its demonstrations show what the
    env retrieves; the warm start and the final policy are evaluated alike."""
    cfg = load_run_config(ROOT / "examples" / "search_r1" / "config.yaml")
    assert cfg.bootstrap is not None and cfg.bootstrap.sft.search_prob is not None
    assert cfg.bootstrap.sft.search_prob < 0.5 and cfg.bootstrap.topk == cfg.retrieval.topk
    assert cfg.eval.before and cfg.eval.after and cfg.eval.num_tasks >= 200
    assert cfg.rollout.eval_sampling.temperature == 0.0  # greedy, before and after
