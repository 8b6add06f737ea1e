"""Synthetic episode dumps of any size (viewer tests and ``bench/viewer.py``), written by the same code as
a run's (:class:`agentrl.episodes.EpisodeDump`'s record format), from a seeded generator."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from agentrl.episodes import DUMP_DIR, FORMAT, episode_record, step_path
from agentrl.types import Status, ToolCallRecord, Trajectory

WORDS = [
    "the",
    "search",
    "answer",
    "river",
    "city",
    "born",
    "year",
    "capital",
    "of",
    "is",
    "who",
    "what",
    "in",
]


def synthetic_run(
    run_dir: str | Path,
    episodes: int,
    group_size: int = 8,
    groups_per_step: int = 4,
    tokens_per_turn: int = 24,
    seed: int = 0,
) -> Path:
    """Write ``episodes`` training episodes (two model turns and one search observation each; some failed,
    some truncated) in steps of ``groups_per_step`` groups, plus ``tokens.json`` and ``run.json``."""
    rng = random.Random(seed)
    run_dir = Path(run_dir)
    (run_dir / DUMP_DIR).mkdir(parents=True, exist_ok=True)
    vocab = [f"{w} " for w in WORDS] + [f"w{i} " for i in range(500)]
    (run_dir / DUMP_DIR / "tokens.json").write_text(json.dumps(vocab))
    (run_dir / DUMP_DIR / "run.json").write_text(json.dumps({"format": FORMAT, "synthetic": True}))
    per_step = group_size * groups_per_step
    done = 0
    step = 0
    while done < episodes:
        step += 1
        records = []
        for k in range(min(per_step, episodes - done)):
            g, s = divmod(k, group_size)
            t = Trajectory(
                task_id=f"task{step}_{g}", group_id=f"{step}:{g}", prompt_ids=[1, 2, 3], sample_index=s
            )
            ids = [rng.randrange(len(vocab)) for _ in range(tokens_per_turn)]
            t.append_model_tokens(
                ids, [-rng.expovariate(2.0) for _ in ids], step - 1, "".join(vocab[i] for i in ids)
            )
            obs = [rng.randrange(len(vocab)) for _ in range(tokens_per_turn // 2)]
            t.append_observation_tokens(
                obs, "<information>" + "".join(vocab[i] for i in obs) + "</information>"
            )
            ids = [rng.randrange(len(vocab)) for _ in range(tokens_per_turn)]
            t.append_model_tokens(
                ids, [-rng.expovariate(2.0) for _ in ids], step - 1, "".join(vocab[i] for i in ids)
            )
            query = t.turns[0].text.strip()
            t.turns[0].text = f"<search>{query}</search>"
            t.turns[0].tool_calls = [
                ToolCallRecord("search", {"query": query}, t.turns[1].text, latency_s=rng.uniform(0.01, 0.2))
            ]
            u = rng.random()
            if u < 0.05:
                t.status, t.error = Status.FAILED, "verifier: ValueError: label missing"
            else:
                t.status = Status.TRUNCATED if u < 0.15 else Status.COMPLETED
                t.reward = float(rng.random() < 0.4)
                t.reward_parts = {"exact_match": t.reward}
            trained = t.status != Status.FAILED
            tlp = [lp + rng.gauss(0, 0.02) for lp in t.rollout_logprobs] if trained else None
            records.append(episode_record(t, "train", step, tlp, "Question: who founded the city?", trained))
        with gzip.open(step_path(run_dir, step), "wb") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records).encode())
        done += len(records)
    return run_dir
