"""Held-out exact match and pass@k of a Search-R1 checkpoint, in process (no engine, no Ray).

:func:`sample_episodes` plays SearchEnv's protocol with a transformers model on the CPU: each turn ends at
``</search>``, ``</answer>`` or the end of turn; a search appends
``\\n\\n<information>{docs}</information>\\n\\n`` from an in-memory retrieval index over the world's corpus
(tokenized on its own, as the orchestrator does); the invalid-action message follows a turn with neither
tag; after ``max_turns`` searching turns the next turn is the last. A sample is correct when its last
``<answer>`` exact-matches a gold answer (the ``exact_match`` verifier's rule). :func:`evaluate_model`
reports greedy exact match, pass@k at a temperature (k samples per task; a task counts when any sample is
correct), which says what RL has to work with (a task no sample solves gives GRPO no signal), and greedy
exact match with the first action forced to ``<search>`` (what the model scores once it searches).

CLI: ``python -m agentrl.examples.search_r1.evaluate --model DIR --world WORLD_DIR [--tasks 200 --k 8]``
prints one JSON line. The demo's recipe runs it on the warm start and on the final policy
(``pass_at_k`` in the run config).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.envs.search import INVALID_ACTION
from agentrl.rewards.builtin import em_score, extract_answer, gold_answers
from agentrl.tools.parsers import parse_search_r1

from .data import Task, load_tasks, make_prompt


def sample_episodes(
    model: Any,
    tokenizer: Any,
    tasks: list[Task],
    search_fn: Callable[[str], str],
    samples: int = 1,
    temperature: float = 0.0,
    max_turns: int = 3,
    max_new_tokens: int = 64,
    max_total_tokens: int = 1024,
    batch_size: int = 64,
    seed: int = 0,
    first_action: str | None = None,
) -> list[list[bool]]:
    """``samples`` episodes per task (greedy when ``temperature`` is 0); per task, which were correct.

    ``first_action`` (e.g. ``"<search>"``, one token) is put at the start of every response instead of being
    sampled: what the model scores once it takes that action."""
    import torch

    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("</search>", "</answer>")]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    episodes: list[dict[str, Any]] = []
    for i, task in enumerate(tasks):
        prompt = [{"role": "user", "content": make_prompt(task["prompt"])}]
        ids = list(
            tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        forced = [tokenizer.convert_tokens_to_ids(first_action)] if first_action else []
        for _ in range(samples):
            episodes.append(
                {
                    "task": i,
                    "label": task["label"],
                    "ids": list(ids) + forced,
                    "text": first_action or "",
                    "turn": 0,
                    "correct": False,
                }
            )
    torch.manual_seed(seed)
    active = list(episodes)
    model.eval()
    while active:
        active.sort(key=lambda e: len(e["ids"]))
        still: list[dict[str, Any]] = []
        for start in range(0, len(active), batch_size):
            chunk = active[start : start + batch_size]
            longest = max(len(e["ids"]) for e in chunk)
            ids = torch.tensor([[pad] * (longest - len(e["ids"])) + e["ids"] for e in chunk])
            attn = torch.tensor([[0] * (longest - len(e["ids"])) + [1] * len(e["ids"]) for e in chunk])
            budget = max(1, min(max_new_tokens, max_total_tokens - longest))
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=attn,
                    max_new_tokens=budget,
                    do_sample=temperature > 0,
                    temperature=temperature if temperature > 0 else None,
                    top_k=0 if temperature > 0 else None,
                    top_p=1.0 if temperature > 0 else None,
                    eos_token_id=[*stop_ids, eos],
                    pad_token_id=pad,
                )
            for row, ep in zip(out[:, longest:].tolist(), chunk, strict=True):
                new: list[int] = []
                for t in row:
                    new.append(t)
                    if t in stop_ids or t == eos:
                        break
                text = tokenizer.decode([t for t in new if t != eos], skip_special_tokens=False)
                ep["text"] += text
                ep["ids"] += new
                if ep["turn"] == 0 and first_action:
                    text = first_action + text  # the turn's action, as the env would see it
                if _step(ep, text, tokenizer, search_fn, max_turns, max_total_tokens):
                    still.append(ep)
        active = still
    results: list[list[bool]] = [[] for _ in tasks]
    for ep in episodes:
        results[ep["task"]].append(ep["correct"])
    return results


def _step(
    ep: dict[str, Any], text: str, tokenizer: Any, search_fn: Callable[[str], str], max_turns: int, limit: int
) -> bool:
    """SearchEnv's step on one turn's text: append the observation; True while the episode goes on."""
    action = parse_search_r1(text)
    turn = ep["turn"]
    ep["turn"] += 1
    if action.kind == "answer":
        ep["correct"] = bool(em_score(extract_answer(ep["text"]) or "", gold_answers(ep["label"])))
        return False
    if turn >= max_turns:
        return False
    obs = (
        INVALID_ACTION
        if action.kind == "invalid"
        else (f"\n\n<information>{search_fn(action.content).strip()}</information>\n\n")
    )
    ep["ids"] += tokenizer(obs, add_special_tokens=False)["input_ids"]
    return len(ep["ids"]) < limit


def evaluate_model(
    model_dir: str | Path,
    corpus: str | Path,
    tasks: list[Task],
    k: int = 8,
    temperature: float = 1.0,
    topk: int = 3,
    max_turns: int = 3,
    max_new_tokens: int = 64,
    seed: int = 0,
) -> dict[str, float]:
    """Greedy exact match and pass@k (``k`` samples at ``temperature``) of ``model_dir`` on ``tasks``."""
    import torch
    import transformers

    from .data import iter_corpus
    from .retrieval_server import RetrievalIndex

    t0 = time.monotonic()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    index = RetrievalIndex(list(iter_corpus(corpus)))
    try:
        search = index.search_fn(topk=topk)
        kw = dict(max_turns=max_turns, max_new_tokens=max_new_tokens, search_fn=search, seed=seed)
        greedy = sample_episodes(model, tok, tasks, samples=1, temperature=0.0, **kw)
        sampled = sample_episodes(model, tok, tasks, samples=k, temperature=temperature, **kw)
        searching = sample_episodes(
            model, tok, tasks, samples=1, temperature=0.0, first_action="<search>", **kw
        )
    finally:
        index.close()
    n = max(1, len(tasks))
    return {
        "greedy_em": sum(r[0] for r in greedy) / n,
        f"pass@{k}": sum(any(r) for r in sampled) / n,
        "sample_em": sum(sum(r) for r in sampled) / max(1, n * k),
        "greedy_em_searching": sum(r[0] for r in searching) / n,
        "tasks": float(len(tasks)),
        "seconds": time.monotonic() - t0,
    }


def checkpoint_to_hf(ckpt_dir: str | Path, template_dir: str | Path, out_dir: str | Path) -> Path:
    """The newest trainer checkpoint under ``ckpt_dir`` (one rank: tp = pp = 1) as an HF dir in ``out_dir``,
    with config and tokenizer files from ``template_dir`` (the model the run started from)."""
    import torch

    from agentrl.trainer.checkpoint import latest_checkpoint
    from agentrl.trainer.model import ModelArch, mcore_to_hf, save_hf_dir

    step_dir = latest_checkpoint(ckpt_dir)
    if step_dir is None:
        raise FileNotFoundError(f"no trainer checkpoint under {ckpt_dir}")
    ranks = sorted(step_dir.glob("rank_*.pt"))
    if len(ranks) != 1:
        raise ValueError(f"{step_dir}: {len(ranks)} rank files; only a one-rank checkpoint is read here")
    state = torch.load(ranks[0], map_location="cpu", weights_only=False)["model"]
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    arch = ModelArch.from_hf_config(json.loads((Path(template_dir) / "config.json").read_text()))
    return save_hf_dir(mcore_to_hf({(0, 0): state}, arch), out_dir, template_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Greedy exact match and pass@k of a Search-R1 checkpoint (CPU).")
    p.add_argument("--model", required=True, help="HF model dir")
    p.add_argument("--world", required=True, help="world dir (corpus.jsonl, test.parquet)")
    p.add_argument("--split", default="test")
    p.add_argument("--tasks", type=int, default=200, help="first N tasks of the split")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    tasks = load_tasks(a.world, a.split, limit=a.tasks)
    out = evaluate_model(a.model, Path(a.world) / "corpus.jsonl", tasks, a.k, a.temperature, seed=a.seed)
    print(json.dumps({"model": str(a.model), **out}))


if __name__ == "__main__":
    main()
