"""The Search-R1 demo's SFT warm start alone: how well it copies names, per SFT seed, schedule, tokenizer.

Builds the demo's world and tiny model, runs the bootstrap's SFT on the practice worlds without the
first-action calibration (so the warm start always searches, as its demonstrations do), and measures it
in process on the held-out tasks (:mod:`agentrl.examples.search_r1.evaluate`): greedy exact match is then
the copy skill (search, read the passage, copy the name into ``<answer>``). Prints one JSON line: the SFT
loss every 100 steps, the final loss, greedy EM, pass@4 at temperature 1, and the seconds taken.

``--tokenizer world`` is the demo's (BPE trained on the evaluation world's text: most of its names are one
token that the warm start never trains on); ``practice`` trains it on the practice worlds' text instead
(every name piece is trained, names take more tokens). Nothing is cached; run with
``ATEN_CPU_CAPABILITY=avx2`` for the other CPU kernels. Example:
``python bench/search_r1_sft.py --seed 1 --steps 1800 --schedule wsd``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0, help="SFT seed (data order)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=8e-3)
    p.add_argument("--schedule", default="wsd", choices=["cosine", "wsd"])
    p.add_argument("--lm-weight", type=float, default=3.0)
    p.add_argument("--tokenizer", default="world", choices=["world", "practice"])
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--tasks", type=int, default=100, help="held-out tasks evaluated")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    import torch
    import transformers

    from agentrl.examples.search_r1.bootstrap import (
        BootstrapConfig,
        practice_rows,
        practice_worlds,
        sft,
        vocab_texts,
    )
    from agentrl.examples.search_r1.data import write_corpus
    from agentrl.examples.search_r1.evaluate import evaluate_model
    from agentrl.examples.search_r1.world import generate_world
    from agentrl.models.tiny import build_tiny_model

    torch.set_num_threads(a.threads)
    cfg = BootstrapConfig(
        world={"seed": 0, "num_entities": 2000, "year_questions": False},
        model={
            "vocab_size": a.vocab,
            "hidden_size": 64,
            "num_hidden_layers": a.layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 192,
        },
        sft={
            "steps": a.steps,
            "batch_size": 16,
            "lr": a.lr,
            "schedule": a.schedule,
            "lm_weight": a.lm_weight,
            "practice_worlds": 20,
            "practice_entities": 500,
            "think": False,
            "seed": a.seed,
        },
    )  # the demo's config.yaml, without the calibration
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="search_r1_sft-"))
    try:
        world = generate_world(**cfg.world.model_dump())
        worlds = list(practice_worlds(cfg)) if a.tokenizer == "practice" else [world]
        build_tiny_model(work / "base", vocab_corpus=vocab_texts(worlds), **cfg.model.model_dump())
        tok = transformers.AutoTokenizer.from_pretrained(work / "base")
        rows = practice_rows(tok, cfg)
        t1 = time.monotonic()
        log: list[str] = []
        stats = sft(work / "base", work / "sft", rows, cfg.sft, log=log.append)
        t2 = time.monotonic()
        write_corpus(work / "corpus.jsonl", world.corpus)
        figures = evaluate_model(work / "sft", work / "corpus.jsonl", world.test[: a.tasks], k=4)  # type: ignore[arg-type]
        answer_tokens = [
            len(tok(" " + t["label"][0], add_special_tokens=False)["input_ids"]) for t in world.test
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                "args": vars(a),
                "cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", "default"),
                "torch": torch.__version__,
                "loss_every_100": [float(s.split()[-1]) for s in log if " loss " in s],
                "final_loss": round(stats["sft/final_loss"], 3),
                **{k: round(v, 3) for k, v in figures.items()},
                "answer_tokens": round(sum(answer_tokens) / len(answer_tokens), 2),
                "setup_s": round(t1 - t0),
                "sft_s": round(t2 - t1),
            }
        )
    )


if __name__ == "__main__":
    main()
