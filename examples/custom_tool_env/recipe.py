"""The recipe of ``config.yaml``: a tiny model warm-started on the expert's demonstrations, then RL.

``prepare`` builds, once (cached under ``model_path``): a tiny random Qwen2-family model whose tokenizer is
trained on the demonstrations' text, then the SFT warm start (:func:`agentrl.sft.warm_start`, settings in
the config's ``warm_start`` section). With your own model, do the warm start by hand and train with the
default recipe::

    python -m agentrl.examples.custom_tool_env.demos --out demos.jsonl
    python -m agentrl.sft --demos demos.jsonl --model pretrained:smollm2-135m-instruct --out runs/sft
    # then model_path: runs/sft, recipe: default, data.path: your tasks
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import Field

from agentrl.recipe import DefaultRecipe, Prepared
from agentrl.run_config import RunConfig
from agentrl.sft import SFTConfig, warm_start
from agentrl.types import Trajectory

from .demos import make_demos
from .env import make_tasks


class WarmStartConfig(RunConfig):
    """The generic run config plus the warm start's section."""

    warm_start: SFTConfig = Field(
        default_factory=lambda: SFTConfig(steps=200, batch_size=8, lr=5e-3),
        description="the SFT warm start on the expert's demonstrations (built once, cached in model_path)",
    )
    demos: int = Field(2000, ge=1, description="expert demonstrations to warm-start on")


def well_formed_calls(trajs: list[Trajectory]) -> float:
    """Share of episodes with at least one calculator call the env parsed and ran."""
    hits = sum(any(c.name == "calculator" for t in traj.turns for c in t.tool_calls) for traj in trajs)
    return hits / max(1, len(trajs))


class UnitConversionRecipe(DefaultRecipe):
    """Tasks from :func:`make_tasks`; the warm-started tiny model at ``model_path`` (built when missing)."""

    config = WarmStartConfig

    def prepare(self) -> Prepared:
        out = Path(self.cfg.model_path)
        wanted = {"config": self.cfg.warm_start.model_dump(), "demos": self.cfg.demos, "seed": self.cfg.seed}
        if not (out / "sft.json").is_file() or json.loads((out / "sft.json").read_text())["recipe"] != wanted:
            self._warm_start(out, wanted)
        tasks = make_tasks(self.cfg.data.max_train_tasks or 400, seed=self.cfg.seed)
        return Prepared(str(out), tasks, make_tasks(self.cfg.eval.num_tasks, seed=self.cfg.seed + 1))

    def _warm_start(self, out: Path, wanted: dict[str, Any]) -> None:
        from transformers.utils.chat_template_utils import render_jinja_template

        from agentrl.models.tiny import CHAT_TEMPLATE, build_tiny_model

        with ThreadPoolExecutor(
            1
        ) as pool:  # prepare() runs inside the job's event loop; make_demos has its own
            demos = pool.submit(make_demos, self.cfg.demos, self.cfg.seed + 1000).result()
        # the tokenizer learns the conversations as the template renders them: short prompts, fast SFT
        texts, _ = render_jinja_template(
            [d["messages"] for d in demos], tools=demos[0]["tools"], chat_template=CHAT_TEMPLATE
        )
        base = build_tiny_model(out.parent / f"{out.name}-base", vocab_corpus=texts, vocab_size=512)
        warm_start(demos, base, out, self.cfg.warm_start)
        info = json.loads((out / "sft.json").read_text())
        (out / "sft.json").write_text(json.dumps({**info, "recipe": wanted}, indent=2))

    def batch_metrics(self, batch: list[Trajectory]) -> dict[str, float]:
        return {"batch/tool_call_rate": well_formed_calls(batch)}

    def eval_metrics(self, trajs: list[Trajectory]) -> dict[str, float]:
        return {**super().eval_metrics(trajs), "eval/tool_call_rate": well_formed_calls(trajs)}
