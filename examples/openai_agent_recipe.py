"""The recipe of ``examples/openai_agent.yaml``: a tiny random Qwen2-family model (built once, cached) and
addition tasks, so the openai-SDK agent of ``examples/openai_agent.py`` trains on a CPU in about a minute.

That run is a smoke run: a randomly initialised model earns no learning signal in a few steps, so its
reward does not move. What it shows is the plumbing: the agent's openai-SDK calls went through the
recording proxy and were trained on token-exact (the trainer's recompute of the engine's logprobs agrees,
``trainer/mismatch_*``). RL from a trained warm start on a real task is the Search-R1 demo,
``python train_async.py``.
Point ``model_path`` at a real checkpoint and ``data.path`` at your tasks to use the default recipe
instead."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from agentrl.recipe import DefaultRecipe, Evals, History, Prepared

SMOKE_NOTE = (
    "smoke run: {steps} steps of a randomly initialised model, so the reward is not "
    "expected to move; it checks that the agent's openai-SDK calls train token-exact. RL "
    "from a trained warm start on a real task: python train_async.py (the Search-R1 demo)"
)


class OpenAIAgentRecipe(DefaultRecipe):
    """Builds the tiny model under ``.cache/openai_agent`` and draws ``a + b`` tasks (seeded)."""

    def prepare(self) -> Prepared:
        from agentrl.models.tiny import build_tiny_model

        print(SMOKE_NOTE.format(steps=self.cfg.steps), flush=True)
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

    def finish(self, result: dict[str, Any], history: History, evals: Evals) -> dict[str, Any]:
        """The default summary, then what the smoke run checked: the largest gap between the engine's and
        the trainer's logprob of a sampled token over the run."""
        result = super().finish(result, history, evals)
        key = "trainer/mismatch_logprob_abs_diff_max"
        gaps = [r[key] for r in history if key in r]
        if gaps:
            print(
                f"token-exact: max |engine logprob - trainer logprob| over the run {max(gaps):.1e} "
                f"(float32 rounding); {SMOKE_NOTE.format(steps=self.cfg.steps)}",
                flush=True,
            )
        return result
