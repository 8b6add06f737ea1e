"""The Search-R1 example's data: the synthetic world (determinism, split by entity, answerability through
retrieval, gold demonstrations) and the real-format parquet/jsonl loader it shares with real data."""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl.examples.search_r1.data import (
    SEARCH_R1_TEMPLATE,
    extract_question,
    format_docs,
    iter_corpus,
    load_tasks,
    make_prompt,
    split_contents,
)
from agentrl.examples.search_r1.retrieval_server import RetrievalIndex
from agentrl.examples.search_r1.world import INFORMATION_TEMPLATE, generate_world, gold_demo


@pytest.fixture(scope="module")
def world():
    return generate_world(seed=0)


@pytest.fixture(scope="module")
def index(world):
    return RetrievalIndex(world.corpus)


def _names_in(task) -> set[str]:
    info = task["info"]
    return {x for x in (info["subject"], info["bridge"], info["answer_entity"]) if x}


# ---- world generation


def test_world_is_deterministic_by_seed(world):
    again = generate_world(seed=0)
    assert again.digest() == world.digest()
    assert again.corpus == world.corpus and again.train == world.train and again.test == world.test
    assert generate_world(seed=1).digest() != world.digest()
    # Also across interpreters with a different string-hash seed (no set/dict-order dependence).
    code = (
        "from agentrl.examples.search_r1.world import generate_world; print(generate_world(seed=0).digest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == world.digest()


def test_world_default_size_and_mix(world):
    stats = world.stats()
    assert 100 <= sum(stats["entities"].values()) <= 300
    assert len(world.train) >= 300 and len(world.test) >= 80
    for split in ("train", "test"):
        assert stats["hops"][split]["1"] > 0 and stats["hops"][split]["2"] > 0
    ids = [t["task_id"] for t in world.train + world.test]
    assert len(ids) == len(set(ids))
    assert len({p["id"] for p in world.corpus}) == len(world.corpus)
    # Short passages (1-3 sentences) with a title line.
    for p in world.corpus:
        title, text = split_contents(p["contents"])
        assert title and 1 <= text.count(".") <= 3, p


def test_split_by_entity_leaves_no_test_entity_in_train(world):
    train_entities = set().union(*(_names_in(t) for t in world.train))
    test_entities = set().union(*(_names_in(t) for t in world.test))
    assert test_entities and train_entities
    assert not train_entities & test_entities
    # Stronger: no entity name that a test question names or answers with occurs in any train question
    # or train answer, so nothing about a test answer can be memorised from the train split.
    train_text = " ".join(t["prompt"] + " " + " ".join(t["label"]) for t in world.train)
    train_words = set(re.findall(r"\w+", train_text))
    for t in world.test:
        for eid in _names_in(t):
            for word in world.entities[eid].name.split():
                if word not in ("Works", "Trading", "Mills", "Foundry", "Company"):
                    assert word not in train_words, (t["task_id"], word)


def test_answers_are_short_and_verbatim_in_the_subject_passage(world):
    by_title = {}
    for p in world.corpus:
        title, text = split_contents(p["contents"])
        by_title[title] = text
    for t in world.train + world.test:
        (answer,) = t["label"]
        assert 1 <= len(answer.split()) <= 2
        info = t["info"]
        last_subject = info["bridge_name"] or info["subject_name"]
        assert answer in by_title[last_subject], t


def test_single_hop_recall_at_3(world, index):
    """The demo's query (the entity named in the question) retrieves the answer in the top 3."""
    single = [t for t in world.train + world.test if t["info"]["hops"] == 1]
    hits = index.search([t["info"]["queries"][0] for t in single], topk=3)
    found = [
        any(t["label"][0] in h["document"]["contents"] for h in hs)
        for t, hs in zip(single, hits, strict=True)
    ]
    recall = sum(found) / len(found)
    assert recall >= 0.95, recall


def test_two_hop_questions_are_answerable_by_two_searches(world, index):
    two = [t for t in world.train + world.test if t["info"]["hops"] == 2]
    assert two
    ok = 0
    for t in two:
        info = t["info"]
        first = " ".join(h["document"]["contents"] for h in index.search([info["subject_name"]], 3)[0])
        if info["bridge_name"] not in first:
            continue
        second = " ".join(h["document"]["contents"] for h in index.search([info["bridge_name"]], 3)[0])
        ok += t["label"][0] in second
        # Not answerable by the first search alone: the answer is in the bridge passage, not the subject's.
    assert ok / len(two) >= 0.95, ok / len(two)


def test_size_and_vocabulary_knobs():
    small = generate_world(seed=3, num_entities=40, num_syllables=10, distractor_rate=0.0, hops=[1])
    big = generate_world(seed=3, num_entities=600)
    assert sum(small.stats()["entities"].values()) < 60 < 500 < sum(big.stats()["entities"].values())
    assert all(t["info"]["hops"] == 1 for t in small.train + small.test)
    assert len(small.corpus) == len(small.entities)  # no distractors
    # A 10-syllable inventory means few distinct name pieces.
    names = " ".join(e.name for e in small.entities.values()).lower()
    assert len(set(re.findall(r"[^aeiou\s]*[aeiou]+", names))) <= 40
    with pytest.raises(ValueError, match="num_entities"):
        generate_world(seed=0, num_entities=3)


def test_vocab_helpers_cover_the_text(world):
    qs = world.questions_for_vocab()
    assert any("<search>" in q for q in qs)  # the prompt template
    prompts = {make_prompt(t["prompt"]) for t in world.train + world.test}
    assert prompts <= set(qs)
    assert world.corpus_text() == [p["contents"] for p in world.corpus]


# ---- gold demonstrations


def test_gold_demo_format_and_grounding(world, index):
    search_fn = index.search_fn(topk=3)
    answer_re = re.compile(r"<answer>(.*?)</answer>", re.S)
    demos = [gold_demo(t, search_fn) for t in world.test]
    assert sum(d.grounded for d in demos) / len(demos) >= 0.95
    for t, d in zip(world.test, demos, strict=True):
        assert d.text == "".join(s for s, _ in d.segments)
        flags = [m for _, m in d.segments]
        assert flags == [True, False] * t["info"]["hops"] + [True]
        for hop, query in enumerate(t["info"]["queries"]):
            model_text, obs = d.segments[2 * hop][0], d.segments[2 * hop + 1][0]
            assert model_text.startswith("<think> ") and model_text.endswith(f"<search> {query} </search>")
            assert obs == INFORMATION_TEMPLATE.format(docs=search_fn(query).strip())
            assert obs.startswith('\n\n<information>Doc 1(Title: "') and obs.endswith(".</information>\n\n")
        assert answer_re.findall(d.text)[-1].strip() == t["label"][0]
    no_think = gold_demo(world.test[0], search_fn, think=False)
    assert no_think.segments[0][0] == f"<search> {world.test[0]['info']['queries'][0]} </search>"


def test_gold_demo_reports_ungrounded_retrieval(world):
    task = next(t for t in world.test if t["info"]["hops"] == 1)
    demo = gold_demo(task, lambda q: "Doc 1(Title: Nothing) nothing here\n")
    assert not demo.grounded and demo.answer == task["label"][0]
    real = {"task_id": "nq-1", "prompt": "who?", "label": ["x"], "data_source": "nq", "info": {}}
    with pytest.raises(ValueError, match="synthetic-world task"):
        gold_demo(real, lambda q: "")


# ---- real-format loader


def test_world_round_trips_through_the_real_format_loader(world, tmp_path):
    paths = world.write(tmp_path)
    assert load_tasks(tmp_path, "train") == world.train
    assert load_tasks(paths["test"]) == world.test
    assert list(iter_corpus(paths["corpus"])) == world.corpus
    rows = pq.read_table(paths["train"]).to_pylist()
    row = rows[0]
    assert row["data_source"] == "synthetic_world"
    assert row["prompt"][0]["role"] == "user"
    assert row["prompt"][0]["content"] == make_prompt(row["extra_info"]["question"])
    assert row["reward_model"] == {"style": "rule", "ground_truth": {"target": world.train[0]["label"]}}
    meta = json.loads(paths["meta"].read_text())
    assert meta["digest"] == world.digest() and meta["train"] == len(world.train)
    assert load_tasks(tmp_path, "train", limit=5) == world.train[:5]


def test_loader_reads_real_search_r1_rows(tmp_path):
    q = "who got the first nobel prize in physics?"
    rows = [
        {  # nq_search.py layout: question/golden_answers columns, numpy-ish list answers
            "id": "train_0",
            "question": q,
            "golden_answers": ["Wilhelm Conrad Röntgen"],
            "data_source": "nq",
            "prompt": [{"role": "user", "content": make_prompt(q)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": ["Wilhelm Conrad Röntgen"]}},
            "extra_info": {"split": "train", "index": 0},
        },
        {  # no question column: recovered from the prompt; answers only in golden_answers
            "id": "train_1",
            "question": None,
            "golden_answers": ["Paris", "Paris, France"],
            "data_source": "hotpotqa",
            "prompt": [{"role": "user", "content": make_prompt("capital of France?")}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": []}},
            "extra_info": {"split": "train", "index": 1},
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    tasks = load_tasks(tmp_path, "train")
    assert tasks[0]["task_id"] == "nq-train_0" and tasks[0]["prompt"] == q
    assert tasks[0]["label"] == ["Wilhelm Conrad Röntgen"] and tasks[0]["data_source"] == "nq"
    assert tasks[1]["prompt"] == "capital of France?" and tasks[1]["label"] == ["Paris", "Paris, France"]
    assert tasks[1]["info"] == {"split": "train", "index": 1}
    hotpot = load_tasks(tmp_path / "train.parquet", data_sources=["hotpotqa"])
    assert [t["task_id"] for t in hotpot] == ["hotpotqa-train_1"]
    # Merged files repeat ids; task ids stay unique (they key GRPO groups).
    pq.write_table(pa.Table.from_pylist(rows + rows), tmp_path / "dup.parquet")
    ids = [t["task_id"] for t in load_tasks(tmp_path / "dup.parquet")]
    assert len(set(ids)) == 4 and ids[:2] == ["nq-train_0", "hotpotqa-train_1"]
    with pytest.raises(ValueError, match="split"):
        load_tasks(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tasks(tmp_path, "test")


def test_loader_names_rows_without_answers(tmp_path):
    row = {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": make_prompt("q?")}],
        "reward_model": {"style": "rule", "ground_truth": {"target": []}},
    }
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="row 0: no gold answers"):
        load_tasks(tmp_path / "x.parquet")


def test_prompt_helpers():
    assert extract_question(make_prompt("  Where is X? ")) == "Where is X?"
    assert extract_question("no template here") == "no template here"
    assert SEARCH_R1_TEMPLATE.endswith("Question: {question}\n")
    assert split_contents('"A title"\nSome text.') == ("A title", "Some text.")
    docs = [
        {"document": {"id": "1", "contents": '"T1"\nx.'}, "score": 1.0},
        {"id": "2", "contents": '"T2"\ny.'},
    ]
    assert format_docs(docs) == 'Doc 1(Title: "T1") x.\nDoc 2(Title: "T2") y.\n'  # quotes kept, as Search-R1


def test_iter_corpus_gz_and_errors(tmp_path):
    good = tmp_path / "c.jsonl.gz"
    with gzip.open(good, "wt") as f:
        f.write(json.dumps({"id": 1, "contents": '"T"\nx'}) + "\n\n")
    assert list(iter_corpus(good)) == [{"id": "1", "contents": '"T"\nx'}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "1", "contents": "a"}) + "\n" + json.dumps({"id": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        list(iter_corpus(bad))


def test_world_cli(tmp_path):
    args = ["--out", str(tmp_path), "--seed", "3", "--num-entities", "60"]
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.examples.search_r1.world", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    summary = json.loads(out.stdout)
    assert summary["digest"] == generate_world(seed=3, num_entities=60).digest()
    for name in ("corpus.jsonl", "train.parquet", "test.parquet", "world.json"):
        assert (Path(tmp_path) / name).is_file()
    assert len(load_tasks(tmp_path, "test")) == summary["test"] > 0


def _segments(word: str, syllables: list[str]) -> bool:
    return (
        re.fullmatch("(?:" + "|".join(sorted(syllables, key=len, reverse=True)) + ")+", word.lower())
        is not None
    )


def test_name_seed_shares_name_pieces_but_no_entities():
    from agentrl.examples.search_r1.world import _COMPANY_SUFFIXES, _syllable_inventory

    syllables = _syllable_inventory(random.Random("names:7"), 48)
    a = generate_world(seed=1, num_entities=200, name_seed=7)
    b = generate_world(seed=2, num_entities=200, name_seed=7)
    other = generate_world(seed=2, num_entities=200)  # name_seed defaults to the seed
    assert generate_world(seed=2, num_entities=200, name_seed=2).digest() == other.digest()

    def words(w):
        return [x for e in w.entities.values() for x in e.name.split() if x not in _COMPANY_SUFFIXES]

    assert all(_segments(x, syllables) for x in words(a) + words(b))
    assert sum(_segments(x, syllables) for x in words(other)) < 0.5 * len(words(other))
    names_a = {e.name for e in a.entities.values()}
    names_b = {e.name for e in b.entities.values()}
    assert len(names_a & names_b) < 0.02 * len(names_a)  # independent draws: at most chance collisions
    assert {t["prompt"] for t in a.train + a.test}.isdisjoint({t["prompt"] for t in b.train + b.test})


def test_year_questions_can_be_left_out():
    w = generate_world(seed=0, num_entities=200, year_questions=False)
    tasks = w.train + w.test
    assert tasks and not any({"born", "founded"} & set(t["info"]["relations"]) for t in tasks)
    assert not any(re.fullmatch(r"\d{4}", t["label"][0]) for t in tasks)
    assert {t["info"]["hops"] for t in tasks} == {1, 2}
    with_years = generate_world(seed=0, num_entities=200)
    assert any(re.fullmatch(r"\d{4}", t["label"][0]) for t in with_years.train)
    assert "founded in" in " ".join(w.corpus_text())  # years stay in the passages


def test_practice_rows_come_from_other_worlds(tmp_path):
    import transformers

    from agentrl.examples.search_r1.bootstrap import BootstrapConfig, practice_rows
    from agentrl.models.tiny import build_tiny_model

    cfg = BootstrapConfig.model_validate(
        {
            "world": {"seed": 0, "num_entities": 80},
            "sft": {"practice_worlds": 2, "practice_entities": 60, "max_demos": 150, "think": False},
        }
    )
    world = generate_world(**cfg.world.model_dump())
    build_tiny_model(
        tmp_path,
        vocab_corpus=world.corpus_text() + world.questions_for_vocab(),
        vocab_size=600,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    rows = practice_rows(tok, cfg)
    assert len(rows) == 150
    assert rows == practice_rows(tok, cfg)  # deterministic
    texts = [tok.decode(r["input_ids"]) for r in rows]
    eval_names = {e.name for e in world.entities.values() if e.kind == "person"}
    assert not any(name in text for name in eval_names for text in texts)
    for r in rows:
        assert len(r["input_ids"]) == len(r["loss_mask"]) and 0 < sum(r["loss_mask"]) < len(r["loss_mask"])


def test_practice_worlds_with_the_world_names_share_names_but_no_fact():
    """``sft.practice_names: world``: the practice worlds are made of the evaluation world's name words, in
    other roles: no passage or question-and-answer of theirs is one of the evaluation world's."""
    from agentrl.examples.search_r1.bootstrap import BootstrapConfig, practice_worlds

    cfg = BootstrapConfig.model_validate(
        {
            "world": {"seed": 0, "num_entities": 300, "year_questions": False},
            "sft": {"practice_worlds": 2, "practice_entities": 120, "practice_names": "world"},
        }
    )
    world = generate_world(**cfg.world.model_dump())
    pool = set(world.name_words())
    assert len(pool) > 300 and not pool & {"Works", "Trading", "Mills", "Foundry", "Company"}
    facts = {p["contents"].split("\n", 1)[1] for p in world.corpus}
    qa = {(t["prompt"], t["label"][0]) for t in world.train + world.test}
    practice = list(practice_worlds(cfg))
    assert practice[0].digest() != practice[1].digest()
    for w in practice:
        words = set(w.name_words())
        assert words <= pool and len(words) > 0.3 * len(pool)  # the world's names, each used once
        assert len({e.name for e in w.entities.values()}) == len(w.entities)
        assert not facts & {p["contents"].split("\n", 1)[1] for p in w.corpus}
        assert len(qa & {(t["prompt"], t["label"][0]) for t in w.train + w.test}) < 0.01 * len(qa)
    # inventory names (the default) stay apart from the world's
    cfg.sft.practice_names = "inventory"
    assert len(set(next(practice_worlds(cfg)).name_words()) & pool) < 0.05 * len(pool)
    with pytest.raises(ValueError, match="name pool exhausted"):
        generate_world(seed=1, num_entities=300, name_pool=sorted(pool)[:50])


@pytest.fixture(scope="module")
def practice_setup(tmp_path_factory):
    import transformers

    from agentrl.examples.search_r1.bootstrap import BootstrapConfig, practice_rows
    from agentrl.models.tiny import build_tiny_model

    cfg = BootstrapConfig.model_validate(
        {
            "world": {"seed": 0, "num_entities": 80},
            "sft": {"practice_worlds": 2, "practice_entities": 60, "max_demos": 120, "think": False},
        }
    )
    world = generate_world(**cfg.world.model_dump())
    model_dir = tmp_path_factory.mktemp("tiny")
    build_tiny_model(
        model_dir,
        vocab_corpus=world.corpus_text() + world.questions_for_vocab(),
        vocab_size=600,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return cfg, model_dir, tok, practice_rows(tok, cfg)


def test_sft_micro_batches_give_the_same_update(practice_setup, tmp_path):
    """Length-sorted chunks are gradient accumulation of one normalized loss: same weights as one chunk."""
    import torch
    import transformers

    from agentrl.examples.search_r1.bootstrap import sft

    cfg, model_dir, _, rows = practice_setup
    weights = []
    for mb in (1, 3):
        # lr 10x below the demo's: Adam turns a rounding-level gradient difference on a near-zero component
        # into up to ~0.2% of a step (1.4e-5 at lr 8e-3 on one of 29k weights, seen with transformers
        # 5.23); the accumulation itself is exact, and the bound below stays at 1e-5.
        sft_cfg = cfg.sft.model_copy(
            update={"steps": 2, "batch_size": 6, "micro_batches": mb, "lr": cfg.sft.lr / 10}
        )
        sft(model_dir, tmp_path / f"mb{mb}", rows, sft_cfg, log=lambda *_: None)
        m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"mb{mb}")
        weights.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    moved = (weights[0] - torch.cat([p.detach().flatten() for p in base.parameters()])).abs().max()
    assert moved > 1e-4  # the steps did train
    assert torch.allclose(weights[0], weights[1], atol=1e-5)


def test_demo_rows_are_the_pieces_tokenized_one_by_one(practice_setup):
    """The demonstrations' rows tokenize each piece (the prompt, each model segment's trained and untrained
    parts, each observation) on its own, as a rollout appends them: the batched tokenization the bootstrap
    uses gives the ids, loss mask and probe mask a call per piece gives."""
    from agentrl.examples.search_r1.bootstrap import _model_pieces, demo_token_rows

    cfg, _, tok, _ = practice_setup
    world = generate_world(**cfg.world.model_dump())
    index = RetrievalIndex(world.corpus)
    try:
        search_fn = index.search_fn(topk=cfg.topk)
        tasks = world.test[:20]
        rows = demo_token_rows(tok, tasks, search_fn, think=False, answer_loss=False)
        want = []
        for task in tasks:
            demo = gold_demo(task, search_fn, think=False)
            if not demo.grounded:
                continue
            prompt = [{"role": "user", "content": make_prompt(task["prompt"])}]
            ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False))
            mask = [0] * len(ids)
            for turn, (text, is_model) in enumerate(demo.segments):
                pieces = _model_pieces(text, turn == 0, False) if is_model else [(text, False)]
                for piece, trained in pieces:
                    seg = tok(piece, add_special_tokens=False)["input_ids"]
                    ids, mask = ids + seg, mask + [int(trained)] * len(seg)
            probe = [int(prev == tok.convert_tokens_to_ids("<answer>")) for prev in [None, *ids[:-1]]]
            want.append({"input_ids": ids, "loss_mask": mask, "probe_mask": probe})
    finally:
        index.close()
    assert len(want) >= 15 and rows == want
    assert all(0 in r["loss_mask"] and 1 in r["loss_mask"] and 1 in r["probe_mask"] for r in rows)


def test_answer_weight_weighs_the_answer_tokens_only(practice_setup):
    """``sft.answer_weight``: the loss mask weighs the tokens between ``<answer>`` and ``</answer>`` 1 + w and
    leaves every other token as it was; an SFT step's loss is normalised by the trained tokens' count, so the
    weight adds w times the answer's share of the plain loss."""
    import torch
    import transformers

    from agentrl.examples.search_r1.bootstrap import practice_rows
    from agentrl.sft import SFTConfig as LoopConfig
    from agentrl.sft import token_nll, train_rows

    cfg, model_dir, tok, rows = practice_setup
    heavy = practice_rows(
        tok, cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"answer_weight": 4.0})})
    )
    assert [r["input_ids"] for r in heavy] == [r["input_ids"] for r in rows]
    a_open, a_close = tok.convert_tokens_to_ids("<answer>"), tok.convert_tokens_to_ids("</answer>")

    def answer_span(ids):  # the response's answer (the prompt names the tags too)
        return len(ids) - 1 - ids[::-1].index(a_open), len(ids) - 1 - ids[::-1].index(a_close)

    for plain, weighted in zip(rows, heavy, strict=True):
        start, end = answer_span(plain["input_ids"])
        inside = [5.0] * (end - start - 1)
        assert weighted["loss_mask"] == plain["loss_mask"][: start + 1] + inside + plain["loss_mask"][end:]

    # one step's loss, taken before the step: the plain loss plus w times the answer's share of it
    batch, pad = rows[:8], tok.pad_token_id or 0
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        nll, mask, _ = token_nll(model, batch, pad, "cpu")
    answers = torch.zeros_like(nll)
    for i, r in enumerate(batch):
        start, end = answer_span(r["input_ids"])
        answers[i, start : end - 1] = 1.0  # the positions predicting the answer's words
    plain_loss = (nll * mask).sum() / (mask > 0).sum()
    answer_share = (nll * answers).sum() / (mask > 0).sum()
    loop = LoopConfig(steps=1, batch_size=8, lm_weight=0.0, micro_batches=1)
    losses = {}
    for name, rows_ in (("plain", batch), ("heavy", heavy[:8])):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        losses[name] = train_rows(model, rows_, loop, pad, log=lambda *_: None)["sft/final_loss"]
    assert losses["plain"] == pytest.approx(plain_loss.item(), rel=1e-5)
    assert losses["heavy"] == pytest.approx((plain_loss + 4.0 * answer_share).item(), rel=1e-5)


def test_first_action_calibration_sets_the_search_probability(practice_setup):
    import torch
    import transformers

    from agentrl.examples.search_r1.bootstrap import SFTConfig, calibrate_first_action

    _, model_dir, tok, rows = practice_setup
    prompts = [r["input_ids"][: r["loss_mask"].index(1)] for r in rows]
    train, held_out = rows[:80], prompts[80:]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = SFTConfig(think=False, search_prob=0.3, calibration_steps=80, calibration_lr=1e-2)
    stats = calibrate_first_action(model, tok, train, cfg)
    assert abs(stats["sft/search_prob"] - 0.3) < 0.05
    s_id, a_id = tok.convert_tokens_to_ids("<search>"), tok.convert_tokens_to_ids("<answer>")
    model.eval()
    with torch.no_grad():
        for p in held_out[:10]:
            probs = model(input_ids=torch.tensor([p])).logits[0, -1].softmax(-1)
            assert abs(probs[s_id].item() - 0.3) < 0.08 and abs(probs[a_id].item() - 0.7) < 0.08
            assert probs.argmax().item() == a_id  # greedy answers without searching


def test_calibration_keep_holds_the_rest_of_the_warm_start(practice_setup):
    """With ``calibration_keep`` the calibration also takes the SFT loss on the demonstrations' tokens after
    the first action: the first action still moves to ``search_prob``, and the loss on the rest ends lower
    than a calibration of the first action alone leaves it."""
    import torch
    import transformers

    from agentrl.examples.search_r1.bootstrap import SFTConfig, _kept_loss, calibrate_first_action

    _, model_dir, tok, rows = practice_setup
    train, held_out = rows[:80], rows[80:]
    after = {}
    for keep in (0.0, 1.0):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        cfg = SFTConfig(
            think=False,
            search_prob=0.3,
            calibration_steps=80,
            calibration_lr=1e-2,
            calibration_keep=keep,
            batch_size=8,
        )
        stats = calibrate_first_action(model, tok, train, cfg)
        assert abs(stats["sft/search_prob"] - 0.3) < 0.05
        model.eval()
        with torch.no_grad():
            after[keep] = _kept_loss(model, held_out, tok.pad_token_id or 0, "cpu").item()
    assert after[1.0] < after[0.0] - 0.1, after


def test_search_prob_needs_think_off():
    from agentrl.config import ConfigError
    from agentrl.recipe import load_run_config

    recipe = "recipe=agentrl.examples.search_r1.recipe:SearchR1Recipe"
    with pytest.raises(ConfigError, match="search_prob"):
        load_run_config(None, [recipe, "bootstrap.sft.search_prob=0.3", "bootstrap.sft.think=true"])
