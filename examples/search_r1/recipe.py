"""The Search-R1 demo as a recipe for ``train_async.py``:
``recipe: agentrl.examples.search_r1.recipe:SearchR1Recipe``.

Around the generic loop it adds (see :mod:`agentrl.recipe` for the hooks):

* config: :class:`SearchR1Config`, the generic run config plus ``bootstrap`` (world, tiny model, SFT
  warm start) and ``retrieval`` (the /retrieve server), ``data.corpus``, and ``auto`` defaults;
* ``prepare``: the bootstrap (cached) when ``model_path`` or ``data`` is ``auto``, then the Search-R1
  parquet tasks (:func:`.data.load_tasks`);
* ``start_services``: the bm25s /retrieve server over the corpus (``retrieval.workers`` processes on one
  port, on a node with ``ray.service_resources``; or ``retrieval.url``), handed to the search env as
  ``retrieval_url`` and ``topk`` (and ``retrieval_api_key``, the run's secret, when it spans hosts);
* ``eval_metrics``: held-out exact match (the share of episodes with reward 1; a failed one is wrong);
  ``batch_metrics``: searches per episode, and the retrieval server's own load over the step (its
  ``/stats``: ``retrieval/busy_frac``, ``retrieval/request_ms_mean``, ... see
  :class:`.retrieval_workers.RetrievalLoad`);
* ``finish``: ``reward_em.png`` (with searches and response length) and the summary table.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from agentrl.config import ConfigModel
from agentrl.recipe import DefaultRecipe, Evals, History, Prepared, plot_run, print_summary, summary_rows
from agentrl.run_config import DataConfig, EnvConfig, RunConfig
from agentrl.types import Status, Trajectory

from .bootstrap import BootstrapConfig
from .retrieval_workers import RetrievalLoad

RECIPE = "agentrl.examples.search_r1.recipe:SearchR1Recipe"
EXACT_MATCH = "eval/exact_match"


class SearchR1DataConfig(DataConfig):
    """Search-R1 parquet tasks (``<path>/train.parquet``, ``<path>/test.parquet``) and the passage corpus."""

    path: str = Field("auto", description="directory or parquet file; auto = the bootstrap's synthetic world")
    corpus: str = Field("auto", description="retrieval corpus jsonl; auto = the bootstrap's world corpus")


class RetrievalConfig(ConfigModel):
    """The Search-R1 /retrieve server the search env queries."""

    enabled: bool = Field(True, description="start a local retrieval server over data.corpus")
    url: str | None = Field(None, description="use this running server instead of starting one")
    topk: int = Field(3, ge=1, description="passages per search")
    # One per engine: each engine's episodes bring as many searches a second as the one engine of a
    # one-GPU run, whose single worker kept a search at 16 ms; a worker is one core (the GIL) and the
    # workers share one memory-mapped index.
    workers: int | None = Field(
        None, ge=1, description="server processes sharing its port (Linux); None: one per engine"
    )


class PassAtKConfig(ConfigModel):
    """After the run: greedy exact match and pass@k of the warm start and of the final policy, in process
    (:mod:`.evaluate`) on the held-out tasks the run evaluates, written to ``summary.json``."""

    k: int = Field(8, ge=1, description="samples per task")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of those samples")
    seed: int = Field(0, description="sampling seed")


class SearchR1Config(RunConfig):
    """A Search-R1 run: the generic run config plus the demo's bootstrap and retrieval sections."""

    recipe: str = Field(RECIPE, description="this recipe (agentrl.recipe)")
    output_dir: str = Field(
        "runs/search_r1", description="metrics, checkpoints, plot, weights for the engines"
    )
    model_path: str = Field(
        "auto", description="HF model dir or pretrained:NAME; auto = the bootstrap's SFT checkpoint"
    )
    bootstrap: BootstrapConfig | None = Field(
        default_factory=BootstrapConfig, description="Search-R1 CPU demo: world, tiny model, SFT warm start"
    )
    data: SearchR1DataConfig = Field(default_factory=SearchR1DataConfig, description="tasks and corpus")
    env: EnvConfig = Field(default_factory=lambda: EnvConfig(name="search"), description="the search env")
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig, description="retrieval server")
    pass_at_k: PassAtKConfig | None = Field(
        None, description="pass@k of the warm start and the final policy after the run (null: skip)"
    )

    @model_validator(mode="after")
    def _needs_bootstrap(self) -> SearchR1Config:
        if self.model_path == "auto" and self.bootstrap is None:
            raise ValueError("model_path is 'auto' but bootstrap is off: give model_path (an HF model dir)")
        if self.data.path == "auto" and self.bootstrap is None:
            raise ValueError("data.path is 'auto' but bootstrap is off: give data.path (Search-R1 parquet)")
        return self


def is_correct(t: Trajectory) -> bool:
    """An episode is right when its reward is 1 (a failed episode counts as wrong)."""
    return t.status != Status.FAILED and (t.reward or 0) >= 1.0


def exact_match(trajs: list[Trajectory]) -> float:
    """Held-out accuracy: the share of episodes whose reward is 1 (a failed episode counts as wrong)."""
    return sum(map(is_correct, trajs)) / max(1, len(trajs))


def standard_error(values: list[float]) -> float:
    """The standard error of the mean of ``values`` (sample standard deviation / sqrt(n); 0 below two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def gain(before: dict[str, bool], after: dict[str, bool]) -> dict[str, float]:
    """Exact match before and after on the tasks both evaluations scored, each with its standard error,
    and the gain with the standard error of the per-task differences (paired: the same tasks)."""
    tasks = [k for k in before if k in after]
    b = [float(before[k]) for k in tasks]
    a = [float(after[k]) for k in tasks]
    n = max(1, len(tasks))
    return {
        "em_before": sum(b) / n,
        "em_before_se": standard_error(b),
        "em_after": sum(a) / n,
        "em_after_se": standard_error(a),
        "em_gain": (sum(a) - sum(b)) / n,
        "em_gain_se": standard_error([y - x for x, y in zip(b, a, strict=True)]),
        "eval_tasks": float(len(tasks)),
    }


def behaviour_panel(ax: Any, rows: History) -> None:
    """What the policy does: searches per episode and response length, against step."""
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r.get("batch/searches", 0) for r in rows], color="C2", label="searches per episode")
    ax.set_xlabel("step (policy version)")
    ax.set_ylabel("searches per episode")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(steps, [r["batch/response_tokens"] for r in rows], color="C3", label="response tokens")
    twin.set_ylabel("response tokens per episode")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left")


class SearchR1Recipe(DefaultRecipe):
    """See the module docstring."""

    config = SearchR1Config
    cfg: SearchR1Config

    def __init__(self, cfg: SearchR1Config) -> None:
        super().__init__(cfg)
        self.per_task: list[dict[str, bool]] = []  # per evaluation: task id -> right
        self.retrieval_load: RetrievalLoad | None = None  # the server's /stats, read once a step

    def prepare(self) -> Prepared:
        """The model dir, the tasks and the corpus; the bootstrap makes what is ``auto`` (cached).

        ``model_path: pretrained:NAME`` is a real model written from the package index (cached, see
        ``agentrl.models.pretrained``); ``auto`` is the bootstrap's SFT checkpoint.
        """
        from agentrl.models.pretrained import resolve_model_path

        from .data import load_tasks

        cfg = self.cfg
        model, data, corpus = resolve_model_path(cfg.model_path), cfg.data.path, cfg.data.corpus
        world: Path | None = None
        if cfg.bootstrap is not None and model == "auto":
            from .bootstrap import bootstrap

            boot = bootstrap(cfg.bootstrap)
            model, world = str(boot.sft_model_dir), boot.world_dir
        elif cfg.bootstrap is not None and "auto" in (data, corpus):  # a real model: only the world is needed
            from .bootstrap import build_world

            world = build_world(cfg.bootstrap)
        if world is not None:
            data = str(world) if data == "auto" else data
            corpus = str(world / "corpus.jsonl") if corpus == "auto" else corpus
        self.corpus, self.model_dir = corpus, model
        train = load_tasks(data, cfg.data.train_split, limit=cfg.data.max_train_tasks)
        test = load_tasks(data, cfg.data.test_split, limit=cfg.eval.num_tasks)
        self.eval_tasks = test
        return Prepared(model, train, test)  # type: ignore[arg-type]  # Task is a TypedDict

    def start_services(self, services: list[Any]) -> dict[str, Any]:
        """The /retrieve server over the corpus (unless ``retrieval.url`` names a running one)."""
        r = self.cfg.retrieval
        env_kwargs: dict[str, Any] = {"topk": r.topk}
        if r.url:
            env_kwargs["retrieval_url"] = r.url
        elif r.enabled:
            import ray

            from agentrl.cluster import start_service

            from .retrieval_workers import start_retrieval_server

            net = self.network  # loopback, or the node's address behind the run's secret
            start = functools.partial(
                start_retrieval_server,
                self.corpus,
                host=net.host,
                workers=self.retrieval_workers(),
                api_key=net.secret,
            )
            services.append(start_service("retrieval", start, resources=self.cfg.ray.service_resources))
            env_kwargs["retrieval_url"] = ray.get(services[-1].url.remote())
            if net.secret:
                env_kwargs["retrieval_api_key"] = net.secret
        if "retrieval_url" in env_kwargs:
            key = env_kwargs.get("retrieval_api_key")
            self.retrieval_load = RetrievalLoad(env_kwargs["retrieval_url"], api_key=key)
        return env_kwargs

    def retrieval_workers(self) -> int:
        """``retrieval.workers``, else one per engine."""
        return self.cfg.retrieval.workers or max(1, self.cfg.engine.num_engines)

    def batch_metrics(self, batch: list[Trajectory]) -> dict[str, float]:
        """Searches per episode (SearchEnv reports ``num_searches`` in its last step's info), and the
        retrieval server's load since the previous step (read from its ``/stats``: a loopback GET of a
        millisecond, once a step, off the episode path)."""
        out = self.retrieval_load.read() if self.retrieval_load is not None else {}
        if batch and any("num_searches" in t.info for t in batch):
            out["batch/searches"] = sum(t.info.get("num_searches", 0) for t in batch) / len(batch)
        return out

    def eval_metrics(self, trajs: list[Trajectory]) -> dict[str, float]:
        """Held-out exact match; each evaluation's per-task results are kept for :meth:`finish`."""
        self.per_task.append({t.task_id: is_correct(t) for t in trajs})
        return {EXACT_MATCH: exact_match(trajs)}

    def finish(self, result: dict[str, Any], history: History, evals: Evals) -> dict[str, Any]:
        """``reward_em.png`` and the summary, with the held-out exact match before and after RL, their
        standard errors and RL's gain over the warm start (see :func:`gain`); those figures lead
        ``summary.json``."""
        out, nan = Path(self.cfg.output_dir), float("nan")
        searches = any("batch/searches" in r for r in history if "batch/reward" in r)
        plot_run(history, evals, out / "reward_em.png", behaviour_panel if searches else None)
        rows = summary_rows(result, history, out, "reward_em.png")
        before, after = result.get("eval_before", {}), result.get("eval_after", {})
        figures = {"em_before": before.get(EXACT_MATCH, nan), "em_after": after.get(EXACT_MATCH, nan)}
        if before and after and len(self.per_task) >= 2:  # the first evaluation and the last, same tasks
            figures = gain(self.per_task[0], self.per_task[-1])
            f, n = figures, int(figures["eval_tasks"])
            shown = {
                "held-out exact match before": f"{f['em_before']:.3f} ± {f['em_before_se']:.3f} "
                f"(greedy, {n} tasks)",
                "held-out exact match after": f"{f['em_after']:.3f} ± {f['em_after_se']:.3f} "
                "(the same tasks)",
            }
            rows = [(k, shown.get(k, v)) for k, v in rows]
            at = next(i for i, (k, _) in enumerate(rows) if k == "held-out exact match after") + 1
            rows.insert(
                at, ("RL gain over the warm start", f"{f['em_gain']:+.3f} ± {f['em_gain_se']:.3f} (paired)")
            )
        print_summary(rows)
        if "em_gain" in figures:
            print(
                f"RL added {figures['em_gain']:+.3f} ± {figures['em_gain_se']:.3f} held-out exact match over "
                f"the warm start ({figures['em_before']:.3f} -> {figures['em_after']:.3f}, greedy, the same "
                f"{int(figures['eval_tasks'])} tasks; ± one standard error)",
                flush=True,
            )
        if self.cfg.pass_at_k is not None:
            result["pass_at_k"] = self.pass_at_k(out)
        return {**figures, **result}

    def pass_at_k(self, out: Path) -> dict[str, dict[str, float]]:
        """Greedy exact match and pass@k of the warm start and of the final checkpoint (see
        :class:`PassAtKConfig`); the final weights are written as an HF dir to ``<output_dir>/final_hf``."""
        from .evaluate import checkpoint_to_hf, evaluate_model

        cfg, p = self.cfg, self.cfg.pass_at_k
        assert p is not None
        kw = dict(
            k=p.k,
            temperature=p.temperature,
            topk=cfg.retrieval.topk,
            max_turns=int(cfg.env.kwargs.get("max_turns", 4)),
            max_new_tokens=cfg.rollout.sampling.max_new_tokens,
            seed=p.seed,
        )
        final = checkpoint_to_hf(out / "checkpoints", self.model_dir, out / "final_hf")
        figures = {
            name: evaluate_model(model, self.corpus, self.eval_tasks, **kw)  # type: ignore[arg-type]
            for name, model in (("warm_start", self.model_dir), ("final", final))
        }
        for name, f in figures.items():
            print(
                f"{name}: greedy exact match {f['greedy_em']:.3f}, pass@{p.k} {f[f'pass@{p.k}']:.3f} "
                f"(temperature {p.temperature}, {f['tasks']:.0f} held-out tasks)",
                flush=True,
            )
        return figures
