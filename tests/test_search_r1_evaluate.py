"""The Search-R1 demo's in-process evaluation (:mod:`agentrl.examples.search_r1.evaluate`): SearchEnv's
protocol played with a scripted model (search, then answer; invalid actions; the last turn; a forced first
action), and a one-rank trainer checkpoint read back as the HF weights it was made from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from agentrl.examples.search_r1.evaluate import checkpoint_to_hf, sample_episodes

TASKS: list[Any] = [
    {
        "task_id": "a",
        "prompt": "Who founded Baiter Works?",
        "label": ["Vazok Tunfu"],
        "data_source": "x",
        "info": {},
    },
    {
        "task_id": "b",
        "prompt": "Where was Suza Gunke born?",
        "label": ["Zezebak"],
        "data_source": "x",
        "info": {},
    },
]
ANSWERS = {"Baiter Works": "Vazok Tunfu", "Suza Gunke": "Zezebak"}


class ScriptedModel:
    """Searches for the question's subject, then answers with what the passage it read says (or, with
    ``invalid``, never writes a tag); ``generate`` has the transformers signature the evaluator uses."""

    def __init__(self, tok: Any, invalid: bool = False) -> None:
        self.tok, self.invalid, self.calls = tok, invalid, 0

    def eval(self) -> None:
        pass

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any) -> torch.Tensor:
        self.calls += 1
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            text = self.tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
            subject = next(s for s in ANSWERS if s in text)
            if self.invalid:
                reply = " I am not sure."
            elif "<information>Doc" in text:  # the prompt itself names the tags
                reply = f" <answer> {ANSWERS[subject]} </answer>"
            elif text.endswith("<search>"):  # the first action was forced
                reply = f" {subject} </search>"
            else:
                reply = f"<search> {subject} </search>"
            new = self.tok(reply, add_special_tokens=False)["input_ids"]
            rows.append(ids + new)
        longest = max(len(r) for r in rows)
        return torch.tensor([r + [self.tok.pad_token_id] * (longest - len(r)) for r in rows])


def test_search_then_answer(tiny_model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    queries: list[str] = []

    def search(query: str) -> str:
        queries.append(query)
        return f'Doc 1(Title: "{query}") {query} is linked to {ANSWERS[query]}.\n'

    got = sample_episodes(ScriptedModel(tok), tok, TASKS, search, samples=3, temperature=1.0)
    assert got == [[True] * 3, [True] * 3]
    assert sorted(set(queries)) == ["Baiter Works", "Suza Gunke"] and len(queries) == 6
    forced = sample_episodes(ScriptedModel(tok), tok, TASKS, search, first_action="<search>")
    assert forced == [[True], [True]]


def test_invalid_actions_end_after_the_last_turn(tiny_model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    model = ScriptedModel(tok, invalid=True)
    got = sample_episodes(model, tok, TASKS, lambda q: "", max_turns=2)
    assert got == [[False], [False]]
    assert model.calls == 3  # turns 0 and 1 get the invalid-action message, turn 2 is the last


def test_checkpoint_to_hf_gives_back_the_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    from agentrl.trainer.model import ModelArch, hf_to_mcore_shards, load_hf_state_dict

    hf = load_hf_state_dict(tiny_model_dir)
    arch = ModelArch.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    step = tmp_path / "ckpt" / "step_00000003"
    step.mkdir(parents=True)
    torch.save({"model": hf_to_mcore_shards(hf, arch)[(0, 0)], "step": 3}, step / "rank_00000.pt")
    (tmp_path / "ckpt" / "latest").write_text(step.name)
    out = checkpoint_to_hf(tmp_path / "ckpt", tiny_model_dir, tmp_path / "hf")
    back = load_hf_state_dict(out)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
