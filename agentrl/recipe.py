"""Recipe: what a run does around the generic loop of ``train_async.py``.

The loop (batch -> train -> sync -> log / eval / checkpoint) is the same for every env and verifier.
The run config's ``recipe`` key (a registered name or ``module:Class``) picks the class that supplies
the rest:

* ``config`` (class attribute): the run's config model, :class:`~agentrl.run_config.RunConfig` or a
  subclass that adds the recipe's own sections; validated like any other field (an unknown one is named).
* ``prepare() -> Prepared(model_dir, train_tasks, eval_tasks)``: before Ray starts; may build them.
* ``start_services(services) -> env kwargs``: after Ray starts, start the servers the env needs with
  :func:`agentrl.cluster.start_service`, append each to ``services`` (the loop stops them, also when
  a later one fails) and return constructor arguments for the env (``env.kwargs`` in the config wins).
  The run sets ``recipe.network`` first (an :class:`agentrl.cluster.Network`): a server binds its
  ``host`` and requires its ``secret`` (off loopback, when the run spans hosts), and the env's client
  sends that key; ``ray.service_resources`` says which nodes may take the servers.
* ``batch_metrics(batch)`` and ``eval_metrics(trajs)``: the recipe's figures for each training batch
  and for the held-out episodes (``eval/...``; the loop logs them and shows them in the progress line).
* ``finish(result, history, evals) -> result``: after shutdown, plot and print; the returned dict is
  saved as ``summary.json``.

The class is built once per run with the validated config (``recipe.cfg``). :class:`DefaultRecipe`
(``recipe: default``) reads JSONL or parquet tasks from ``data.path``, starts no service, reports the
held-out mean reward and writes ``reward.png`` and a summary. Subclass it and override what differs
(``agentrl.examples.search_r1.recipe`` is the Search-R1 demo's)::

    from agentrl.recipe import DefaultRecipe, Prepared

    class CountdownRecipe(DefaultRecipe):
        def prepare(self) -> Prepared:
            tasks = [{"prompt": f"Reach {n} with 3, 5, 7.", "label": n} for n in range(10, 60)]
            return Prepared(self.cfg.model_path, tasks[:40], tasks[40:])

        def eval_metrics(self, trajs):
            return {"eval/solved": sum((t.reward or 0) >= 1 for t in trajs) / max(1, len(trajs))}

and in the run config: ``recipe: my_pkg.recipes:CountdownRecipe``. :func:`check_recipe` lists what is
wrong with a recipe class; :func:`load_run_config` reads the ``recipe`` key first, then validates the
whole file with that recipe's config model.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol

from agentrl.cluster import Network
from agentrl.config import ConfigError, build_config, read_config
from agentrl.registry import Registry
from agentrl.run_config import RunConfig
from agentrl.types import Status, Trajectory

Task = dict[str, Any]
History = list[dict[str, float]]
Evals = list[tuple[int, dict[str, float]]]  # (step, eval_metrics) of each held-out evaluation


class Prepared(NamedTuple):
    """What a recipe prepares before the run: the HF model dir and the tasks."""

    model_dir: str
    train_tasks: list[Task]
    eval_tasks: list[Task]  # held-out, one greedy episode each; empty: no evaluation


class Recipe(Protocol):
    """What ``train_async.py`` asks of a run's recipe (see the module docstring)."""

    config: ClassVar[type[RunConfig]]
    cfg: RunConfig
    network: Network  # set by the run before start_services

    def prepare(self) -> Prepared: ...

    def start_services(self, services: list[Any]) -> dict[str, Any]: ...

    def batch_metrics(self, batch: list[Trajectory]) -> dict[str, float]: ...

    def eval_metrics(self, trajs: list[Trajectory]) -> dict[str, float]: ...

    def finish(self, result: dict[str, Any], history: History, evals: Evals) -> dict[str, Any]: ...


HOOKS = ("prepare", "start_services", "batch_metrics", "eval_metrics", "finish")


# ---- tasks from files ---------------------------------------------------------------------------------
_TASK_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


def task_file(path: str | Path, split: str) -> Path | None:
    """The file of ``split`` under a directory (``<split>.jsonl``, ``.jsonl.gz`` or ``.parquet``; None when
    there is none), or ``path`` itself when it is a file."""
    path = Path(path)
    if not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"data.path: no task file or directory at {path}")
        return path
    return next((path / f"{split}{s}" for s in _TASK_SUFFIXES if (path / f"{split}{s}").is_file()), None)


def read_tasks(file: str | Path, limit: int | None = None) -> list[Task]:
    """Task dicts from a JSONL file (one JSON object a line, ``.gz`` allowed) or a parquet file (one a
    row), at most ``limit``. A line that is not an object fails with its file and line number."""
    file = Path(file)
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(file).to_pylist()[:limit]
    if not file.name.endswith((".jsonl", ".jsonl.gz")):
        raise ValueError(f"data.path: {file} is neither JSONL (.jsonl, .jsonl.gz) nor parquet")
    tasks: list[Task] = []
    with gzip.open(file, "rt") if file.suffix == ".gz" else file.open() as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(tasks) >= limit:
                break
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}:{lineno}: not JSON: {err}") from None
            if not isinstance(task, dict):
                raise ValueError(f"{file}:{lineno}: a task must be a JSON object, got {type(task).__name__}")
            tasks.append(task)
    return tasks


# ---- reporting helpers (the default recipe's; other recipes reuse them) -----------------------------
def metric_label(key: str) -> str:
    """``eval/exact_match`` -> ``exact match`` (how figures are named in logs, plots and summaries)."""
    return key.rsplit("/", 1)[-1].replace("_", " ")


def plot_run(
    history: History, evals: Evals, path: Path, panel: Callable[[Any, History], None] | None = None
) -> None:
    """Train reward (batch mean) and every held-out figure against step, as a PNG; ``panel(ax, rows)``
    draws a second panel from the training rows (e.g. what the policy does)."""
    from matplotlib.figure import Figure  # a figure of its own: no pyplot state, no GUI backend

    rows = [r for r in history if "batch/reward" in r]
    fig = Figure(figsize=(12 if panel else 7, 4))
    axes = fig.subplots(1, 2 if panel else 1, squeeze=False)
    ax = axes[0][0]
    ax.plot([r["step"] for r in rows], [r["batch/reward"] for r in rows], label="train reward (batch mean)")
    for key in dict.fromkeys(k for _, m in evals for k in m):
        points = [(s, m[key]) for s, m in evals if key in m]
        ax.plot([s for s, _ in points], [v for _, v in points], "o-", label=f"held-out {metric_label(key)}")
    values = [r["batch/reward"] for r in rows] + [v for _, m in evals for v in m.values()]
    if all(0 <= v <= 1 for v in values):
        ax.set_ylim(0, 1)
    ax.set_xlabel("step (policy version)")
    ax.grid(alpha=0.3)
    ax.legend()
    if panel:
        panel(axes[0][1], rows)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary_rows(result: dict[str, Any], history: History, out: Path, plot: str) -> list[tuple[str, str]]:
    """The run's summary table: held-out figures before and after, steps, reward, times, task counts."""
    nan = float("nan")
    acc = result.get("accounting", {})
    final_reward = next((r["batch/reward"] for r in reversed(history) if "batch/reward" in r), nan)
    return [
        *(
            (f"held-out {metric_label(k)} {when}", f"{v:.3f}")
            for when in ("before", "after")
            for k, v in result.get(f"eval_{when}", {}).items()
        ),
        ("steps / policy version", f"{result['steps']} / {result['policy_version']}"),
        ("final train reward", f"{final_reward:.3f}"),
        ("wall time", f"{result['wall_s']:.0f} s"),
        (
            "step time: wait / train / sync",
            " / ".join(f"{result.get(f'mean_{k}_s', nan):.2f}" for k in ("wait_batch", "train", "sync"))
            + " s",
        ),
        ("tasks trained / dropped", f"{acc.get('trained', 0)} / {acc.get('dropped', 0)}"),
        ("outputs", f"{out}/ ({', '.join(run_outputs(out, plot))})"),
    ]


def run_outputs(out: Path, plot: str) -> list[str]:
    """What the run wrote under ``out`` that the summary names: the metrics, TensorBoard logs (only when
    the tensorboard package wrote them), the plot and checkpoints, as they exist; ``summary.json`` is
    written right after the summary is printed."""
    names = ["metrics.jsonl", "tb/", plot, "checkpoints/"]
    return [n for n in names if (out / n.rstrip("/")).exists()] + ["summary.json"]


def print_summary(rows: list[tuple[str, str]]) -> None:
    """Print the summary table (two aligned columns) under a ``summary`` heading."""
    width = max(len(k) for k, _ in rows)
    print("\nsummary\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows), flush=True)


# ---- the default recipe -------------------------------------------------------------------------------
class DefaultRecipe:
    """Any env and verifier: tasks from ``data.path`` (JSONL or parquet), no services, held-out mean
    reward and failure share, ``reward.png`` and a summary table. Subclass it to change one hook."""

    config: ClassVar[type[RunConfig]] = RunConfig

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.network = Network()  # loopback until the run says otherwise

    def prepare(self) -> Prepared:
        """``model_path`` (``pretrained:NAME`` converted, cached) and the tasks of ``data.path``'s splits;
        a single file holds training tasks only."""
        from agentrl.models.pretrained import resolve_model_path

        data = self.cfg.data
        train_file = task_file(data.path, data.train_split)
        if train_file is None:
            raise FileNotFoundError(
                f"data.path: {data.path} has no {data.train_split}.jsonl, "
                ".jsonl.gz or .parquet (data.train_split)"
            )
        eval_file = task_file(data.path, data.test_split) if Path(data.path).is_dir() else None
        eval_tasks = read_tasks(eval_file, self.cfg.eval.num_tasks) if eval_file else []
        if not eval_tasks and (self.cfg.eval.before or self.cfg.eval.after or self.cfg.eval.interval):
            print(f"no held-out tasks ({data.test_split} split) under {data.path}: no evaluation", flush=True)
        train_tasks = read_tasks(train_file, data.max_train_tasks)
        if not train_tasks:
            raise ValueError(f"data.path: {train_file} holds no tasks")
        return Prepared(resolve_model_path(self.cfg.model_path), train_tasks, eval_tasks)

    def start_services(self, services: list[Any]) -> dict[str, Any]:
        """No servers; the env gets ``env.kwargs`` alone."""
        return {}

    def batch_metrics(self, batch: list[Trajectory]) -> dict[str, float]:
        """Nothing beyond the loop's own batch figures (reward, turns, tokens, staleness)."""
        return {}

    def eval_metrics(self, trajs: list[Trajectory]) -> dict[str, float]:
        """Mean reward (a failed episode counts 0) and the share of failed episodes."""
        n = max(1, len(trajs))
        failed = sum(t.status == Status.FAILED for t in trajs)
        reward = sum(t.reward or 0.0 for t in trajs if t.status != Status.FAILED)
        return {"eval/reward": reward / n, "eval/failed": failed / n}

    def finish(self, result: dict[str, Any], history: History, evals: Evals) -> dict[str, Any]:
        """Write ``reward.png``, print the summary table; the result is saved unchanged."""
        out = Path(self.cfg.output_dir)
        plot_run(history, evals, out / "reward.png")
        print_summary(summary_rows(result, history, out, "reward.png"))
        return result


# ---- resolving and loading ----------------------------------------------------------------------------
recipes: Registry[Any] = Registry("recipe")
recipes.add("default", DefaultRecipe)
register_recipe = recipes.register


def check_recipe(obj: Any) -> list[str]:
    """What is wrong with a recipe class, as precise complaints (empty when it is fine)."""
    if not isinstance(obj, type):
        return [f"a recipe is a class, got {obj!r}"]
    problems = []
    config = getattr(obj, "config", None)
    if not (isinstance(config, type) and issubclass(config, RunConfig)):
        problems.append(f"config must be RunConfig or a subclass of it, got {config!r}")
    problems += [f"{hook}() is missing" for hook in HOOKS if not callable(getattr(obj, hook, None))]
    return problems


def resolve_recipe(name: str) -> type[Recipe]:
    """The recipe class for ``name`` (registered, or ``module:Class``); a ConfigError naming ``recipe``."""
    try:
        cls = recipes.get(name)
    except KeyError as err:
        raise ConfigError(f"recipe: {err.args[0]}") from None
    problems = check_recipe(cls)
    if problems:
        raise ConfigError(f"recipe: {name!r}: " + "; ".join(problems))
    return cls


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """A run config from YAML (optional) plus ``key=value`` overrides, validated by its recipe's config
    model (``recipe`` read first; default: ``default``). Errors name every bad field."""
    data, source = read_config(path, overrides)
    name = data.get("recipe", "default")
    if not isinstance(name, str):
        raise ConfigError(
            f"invalid config ({source}):\n  recipe: a recipe name or module:Class, got {name!r}"
        )
    cls = resolve_recipe(name)
    try:
        return build_config(cls.config, data, source)
    except ConfigError as err:
        if "recipe" in data or "unknown field" not in str(err):
            raise
        raise ConfigError(
            f"{err}\n  (no recipe is set, so this is validated as the default "
            "recipe's RunConfig; sections of another recipe, such as the "
            "Search-R1 demo's bootstrap and retrieval, need recipe: module:Class)"
        ) from None


def make_recipe(cfg: RunConfig) -> Recipe:
    """The run's recipe object, built with its validated config."""
    cls = resolve_recipe(cfg.recipe)
    if not isinstance(cfg, cls.config):
        raise ConfigError(
            f"recipe: {cfg.recipe!r} takes a {cls.config.__name__}, got a {type(cfg).__name__} "
            "(load the config with agentrl.recipe.load_run_config)"
        )
    return cls(cfg)  # type: ignore[call-arg]  # a recipe class takes its config


# ---- what `python train_async.py --help` shows after the flags ------------------------------------------
def _examples_dir() -> Path | None:
    """Where the example configs are (the repository's examples/, or the installed agentrl.examples)."""
    import importlib.util

    spec = importlib.util.find_spec("agentrl.examples")  # locates it without importing the examples
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is below it (as a user types it), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _config_line(path: Path) -> tuple[str, str]:
    """(recipe, first sentence of the header comment) of an example run config."""
    import yaml

    text = path.read_text()
    data = yaml.safe_load(text) or {}
    recipe = data.get("recipe", "default") if isinstance(data, dict) else "default"
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    sentence = " ".join(header).split(". ")[0].split(": ")[0].rstrip(".")
    return str(recipe), sentence


def describe_for_help(
    default_config: str | Path | None = None, examples_dir: Path | None = None, width: int = 100
) -> str:
    """The text after the flags of ``python train_async.py --help`` (argparse's ``epilog``; keep its line
    breaks with ``RawDescriptionHelpFormatter``): where every config field is described, the registered
    recipes, and the example run configs, each with what it runs and its recipe; ``default_config`` (the
    config the job reads without ``--config``) is marked."""
    import textwrap

    examples_dir = examples_dir or _examples_dir()
    docs = examples_dir.parent / "docs" / "reference" / "config.md" if examples_dir else None
    reference = _shown(docs) if docs is not None and docs.is_file() else "docs/reference/config.md"
    lines = [
        "config: a YAML file (--config) plus key=value overrides; every field with its type, default and",
        f"  description: {reference}",
        f"recipes (the config's recipe key): registered {', '.join(recipes.names())}; or any module:Class",
        "  (a class with the hooks of agentrl.recipe.Recipe, e.g. a DefaultRecipe subclass)",
    ]
    configs = []
    if examples_dir is not None:
        # the top level's, then each example's folder (search_r1, custom_tool_env, scale, ...)
        configs = sorted(examples_dir.glob("*.yaml")) + sorted(examples_dir.glob("*/*.yaml"))
    if configs:
        lines.append("example configs (--config PATH):")
    default = Path(default_config).resolve() if default_config else None
    for path in configs:
        try:
            recipe, about = _config_line(path)
        except Exception as err:  # a broken example must not break --help
            recipe, about = "?", f"unreadable: {err}"
        about += " (the default config)" if path.resolve() == default else ""
        lines.append(f"  {_shown(path)}")
        for text in (about, f"recipe {recipe}"):
            lines += textwrap.wrap(text, width=width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)
