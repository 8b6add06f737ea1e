"""The recipe of ``examples/openai_agent.yaml``: a tiny random Qwen2-family model (built once, cached) and
addition tasks, so the openai-SDK agent of ``examples/openai_agent.py`` trains on a CPU in minutes.
Point ``model_path`` at a real checkpoint and ``data.path`` at your tasks to use the default recipe
instead."""

from __future__ import annotations

import random
from pathlib import Path

from agentrl.recipe import DefaultRecipe, Prepared


class OpenAIAgentRecipe(DefaultRecipe):
    """Builds the tiny model under ``.cache/openai_agent`` and draws ``a + b`` tasks (seeded)."""

    def prepare(self) -> Prepared:
        from agentrl.models.tiny import build_tiny_model

        model_dir = Path(".cache/openai_agent/model")
        if not (model_dir / "config.json").is_file():
            corpus = [f"What is {a} plus {b}? The answer is {a + b}." for a in range(30) for b in range(30)]
            build_tiny_model(model_dir, arch="qwen2", vocab_corpus=corpus, seed=self.cfg.seed)
        rng = random.Random(self.cfg.seed)
        tasks = []
        for _ in range(240):
            a, b = rng.randrange(20), rng.randrange(20)
            tasks.append({"prompt": f"What is {a} plus {b}? Use the add tool.", "label": a + b})
        return Prepared(str(model_dir), tasks[:200], tasks[200:])
