"""A synthetic world for Search-R1 style training: fictional entities, a passage corpus, QA tasks.

``generate_world(seed, num_entities)`` builds, deterministically by seed, a set of countries, each with
rivers, cities, people and companies whose names are made up from syllables ("Talen Morvik" was born in
"Velora", a city in "Dantar", and founded "Korrin Works"). Links stay inside one country, and the split
is BY COUNTRY: every entity a test question names or answers with (subject, bridge, answer) belongs to a
test country, which no train question touches, so test answers cannot be memorised from training; only
literal values (years) can coincide. The corpus holds one short Wikipedia-like passage per entity
(Search-R1 jsonl: ``{"id", "contents": "\\"Title\\"\\ntext"}``) plus distractor passages that mention
the same names next to other cities and years. Questions use one regular template per relation:
single-hop ("Where was Talen Morvik born?") and two-hop ("In which country was Talen Morvik born?": search
the person, read the city, search the city, read the country). Every answer occurs verbatim in the passage
that a search for the entity named in the question (or the bridge entity) returns.

Worlds built with the same ``name_seed`` draw names from the same syllable inventory but share no entity or
fact: the bootstrap's SFT warm start practises on such "practice worlds" (fresh names every demonstration,
so copying from the context is the only way to lower the loss) and never sees the evaluation world.

``World.write(dir)`` writes ``corpus.jsonl``, ``train.parquet``, ``test.parquet`` (Search-R1 rows, read
back by :mod:`.data`) and ``world.json``. :func:`gold_demo` renders a task's gold trajectory in the
Search-R1 format through a caller-supplied ``search_fn``, so SFT demonstrations show the very retrieval
results the env will return. CLI: ``python -m agentrl.examples.search_r1.world --out DIR --seed 0``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from agentrl.config import ConfigModel

from .data import SEARCH_R1_TEMPLATE, Task, make_contents, make_prompt, row_to_task, write_corpus, write_tasks

DATA_SOURCE = "synthetic_world"
#: bumped whenever the same config would generate different text; include it in cache keys
WORLD_FORMAT_VERSION = 2

# Syllable parts. A world draws a fixed inventory of `num_syllables` syllables from their product, so the
# number of distinct name pieces (and hence the BPE vocabulary a tiny model needs) is a knob.
_ONSETS = "b d f g k l m n p r s t v z br dr kr tr st th".split()  # the first 14 are the common ones
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["n", "r", "l", "s", "m", "k", "nd", "rn"]
_OCCUPATIONS = ["painter", "merchant", "sailor", "poet", "engineer", "weaver", "scholar", "baker"]
_COMPANY_SUFFIXES = ["Works", "Trading", "Mills", "Foundry", "Company"]

# One regular template per relation: the question naming the subject {s}; the fact sentence the gold
# demonstration "reads" out of the passage; what the demo says it is looking for.
_RELATIONS: dict[str, dict[str, str]] = {
    rel: {"question": q, "fact": fact, "need": need}
    for rel, q, fact, need in [
        ("born_in", "Where was {s} born?", "{s} was born in {o}.", "where {s} was born"),
        ("born", "In which year was {s} born?", "{s} was born in {o}.", "when {s} was born"),
        ("founder", "Who founded {s}?", "{s} was founded by {o}.", "who founded {s}"),
        ("founded", "In which year was {s} founded?", "{s} was founded in {o}.", "when {s} was founded"),
        ("based_in", "In which city is {s} based?", "{s} is based in {o}.", "where {s} is based"),
        ("country", "In which country is {s}?", "{s} is in {o}.", "which country {s} is in"),
        (
            "river",
            "Which river flows through {s}?",
            "The {o} river flows through {s}.",
            "which river flows through {s}",
        ),
        ("capital", "What is the capital of {s}?", "The capital of {s} is {o}.", "the capital of {s}"),
        ("company", "Which company did {s} found?", "{s} founded {o}.", "which company {s} founded"),
    ]
}
# Two-hop chains: (subject kind, first relation, second relation, question template).
_CHAINS: list[tuple[str, str, str, str]] = [
    ("person", "born_in", "country", "In which country was {s} born?"),
    ("person", "company", "founded", "In which year was the company founded by {s} founded?"),
    ("company", "founder", "born_in", "Where was the founder of {s} born?"),
    ("company", "founder", "born", "In which year was the founder of {s} born?"),
    ("company", "based_in", "river", "Which river flows through the city where {s} is based?"),
    ("city", "country", "capital", "What is the capital of the country where {s} is?"),
]
#: relations whose value is a year (a literal, not an entity)
_YEAR_RELATIONS = frozenset({"born", "founded"})
# Single-hop questions asked per subject kind (a person's "company" serves only as a two-hop bridge).
_SINGLE: dict[str, list[str]] = {
    "person": ["born_in", "born"],
    "company": ["founder", "founded", "based_in"],
    "city": ["country", "river", "founded"],
    "country": ["capital"],
}


class WorldConfig(ConfigModel):
    """Size and shape of a synthetic world (all defaults sized for a tiny CPU model)."""

    seed: int = Field(0, description="RNG seed; the same seed and config give a byte-identical world")
    num_entities: int = Field(
        200, ge=10, description="approximate number of entities (sets the number of countries)"
    )
    rivers_per_country: int = Field(1, ge=1, description="rivers per country")
    cities_per_country: int = Field(3, ge=1, description="cities per country (the first is the capital)")
    people_per_city: int = Field(3, ge=1, description="people born in each city")
    companies_per_country: int = Field(
        3, ge=0, description="companies per country, each founded by a distinct local person"
    )
    num_syllables: int = Field(
        48, ge=8, le=1760, description="size of the syllable inventory names are built from"
    )
    name_seed: int | None = Field(
        None,
        description="seed of the syllable inventory (default: seed); worlds that share it share name pieces,"
        " and so one tokenizer, but not entities or facts",
    )
    year_questions: bool = Field(
        True,
        description="ask questions whose answer is a year (copying four digit tokens out of passages full of"
        " other years is the hardest part for a tiny model); years stay in the passages either way",
    )
    distractor_rate: float = Field(
        0.5, ge=0.0, le=1.0, description="probability that an entity gets a distractor passage"
    )
    hops: list[int] = Field([1, 2], description="question kinds to generate: 1 = single-hop, 2 = two-hop")
    test_fraction: float = Field(
        0.25, gt=0.0, lt=1.0, description="fraction of countries whose questions form the test split"
    )

    @property
    def inventory_seed(self) -> int:
        """The seed the syllable inventory is drawn with: ``name_seed``, or ``seed`` when that is unset."""
        return self.seed if self.name_seed is None else self.name_seed


@dataclass
class Entity:
    """One fictional entity. ``attrs`` maps a relation to an entity id or a literal (year, occupation)."""

    id: str
    kind: str  # country | river | city | person | company
    name: str
    region: int  # index of the country it belongs to (the unit of the train/test split)
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class World:
    """A generated world: entities, corpus passages, and train/test tasks (agentrl task dicts)."""

    config: WorldConfig
    entities: dict[str, Entity]
    corpus: list[dict[str, str]]
    train: list[Task]
    test: list[Task]
    rows: dict[str, list[dict[str, Any]]]  # split -> Search-R1 parquet rows (what write() stores)

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write ``corpus.jsonl``, ``train.parquet``, ``test.parquet`` and ``world.json`` into ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {
            "corpus": write_corpus(out / "corpus.jsonl", self.corpus),
            "train": write_tasks(out / "train.parquet", self.rows["train"]),
            "test": write_tasks(out / "test.parquet", self.rows["test"]),
        }
        meta = {
            "format_version": WORLD_FORMAT_VERSION,
            "config": self.config.model_dump(),
            "digest": self.digest(),
            **self.stats(),
        }
        (out / "world.json").write_text(json.dumps(meta, indent=2) + "\n")
        paths["meta"] = out / "world.json"
        return paths

    def stats(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for e in self.entities.values():
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
        hops = {
            split: {str(h): sum(1 for t in tasks if t["info"]["hops"] == h) for h in (1, 2)}
            for split, tasks in (("train", self.train), ("test", self.test))
        }
        return {
            "entities": kinds,
            "passages": len(self.corpus),
            "train": len(self.train),
            "test": len(self.test),
            "hops": hops,
        }

    def digest(self) -> str:
        """sha256 over corpus and tasks: equal digests mean identical worlds."""
        blob = json.dumps([self.corpus, self.rows], sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()

    def name_words(self) -> list[str]:
        """The words the entities' names are made of (a company's suffix, a common word, left out), sorted."""
        words = {w for e in self.entities.values() for w in e.name.split()}
        return sorted(words - set(_COMPANY_SUFFIXES))

    def corpus_text(self) -> list[str]:
        """Every passage's text (title line included), for training a tokenizer."""
        return [p["contents"] for p in self.corpus]

    def questions_for_vocab(self) -> list[str]:
        """Templated prompts (question included) and the demo's phrasing, for training a tokenizer."""
        texts = []
        for task in self.train + self.test:
            info = task["info"]
            # The whole templated prompt, once per task: BPE then merges the template's words too, so the
            # ~100-word Search-R1 prompt costs a tiny model far fewer tokens.
            texts.append(make_prompt(task["prompt"]))
            texts.extend(f"I need to find {n}. Now I need to find {n}." for n in info["needs"])
            texts.extend(info["facts"])
        return texts


def _syllable_inventory(rng: random.Random, n: int) -> list[str]:
    """`n` distinct syllables, mostly short (consonant + vowel) so names stay short and pronounceable."""
    n = min(n, len(_ONSETS) * len(_VOWELS) * len(_CODAS))
    simple_onsets, simple_vowels = _ONSETS[:14], _VOWELS[:5]
    out: list[str] = []
    while len(out) < n:
        onset = rng.choice(simple_onsets if rng.random() < 0.8 else _ONSETS)
        vowel = rng.choice(simple_vowels if rng.random() < 0.8 else _VOWELS)
        coda = "" if rng.random() < 0.6 else rng.choice(_CODAS)
        if onset + vowel + coda not in out:
            out.append(onset + vowel + coda)
    return out


class _Namer:
    """Unique capitalised names built from the syllable inventory; a name word is never reused. With a
    ``pool``, the words are drawn from it instead (in a random order, each once)."""

    def __init__(self, rng: random.Random, syllables: list[str], pool: Sequence[str] | None = None) -> None:
        from .retrieval_server import import_bm25s

        self.pool = list(pool) if pool is not None else None
        if self.pool is not None:
            rng.shuffle(self.pool)

        stopwords = import_bm25s().stopwords.STOPWORDS_EN

        self.rng, self.syllables = rng, syllables
        template_words = " ".join(
            [SEARCH_R1_TEMPLATE, *_OCCUPATIONS, *_COMPANY_SUFFIXES]
            + [t for r in _RELATIONS.values() for t in r.values()]
            + [c[3] for c in _CHAINS]
            + ["country city river company fair market portrait painting tower bridge history port building"]
            + ["independent largest"]
        )
        self.used = {w.strip(".,?<>/{}").lower() for w in template_words.split()} | set(stopwords)

    def word(self) -> str:
        if self.pool is not None:
            if not self.pool:
                raise ValueError("name pool exhausted: give a larger pool or fewer entities")
            return self.pool.pop()
        for _ in range(1000):
            k = self.rng.choice((2, 2, 3))
            w = "".join(self.rng.choice(self.syllables) for _ in range(k)).capitalize()
            if 4 <= len(w) <= 12 and w.lower() not in self.used:
                self.used.add(w.lower())
                return w
        raise ValueError(f"name space exhausted: raise num_syllables (now {len(self.syllables)})")


def _build_entities(
    cfg: WorldConfig, rng: random.Random, name_pool: Sequence[str] | None = None
) -> tuple[dict[str, Entity], int]:
    per_country = (
        1
        + cfg.rivers_per_country
        + cfg.cities_per_country * (1 + cfg.people_per_city)
        + cfg.companies_per_country
    )
    num_countries = max(2, round(cfg.num_entities / per_country))
    inventory = _syllable_inventory(random.Random(f"names:{cfg.inventory_seed}"), cfg.num_syllables)
    namer = _Namer(rng, inventory, name_pool)
    ents: dict[str, Entity] = {}
    counts: dict[str, int] = {}

    def add(kind: str, name: str, region: int, **attrs: Any) -> Entity:
        counts[kind] = counts.get(kind, 0) + 1
        e = Entity(id=f"{kind}{counts[kind] - 1:05d}", kind=kind, name=name, region=region, attrs=attrs)
        ents[e.id] = e
        return e

    for r in range(num_countries):
        country = add("country", namer.word(), r)
        rivers = [add("river", namer.word(), r, country=country.id) for _ in range(cfg.rivers_per_country)]
        cities = [
            add(
                "city",
                namer.word(),
                r,
                country=country.id,
                river=rng.choice(rivers).id,
                founded=rng.randint(1050, 1750),
            )
            for _ in range(cfg.cities_per_country)
        ]
        country.attrs["capital"] = cities[0].id
        people = [
            add(
                "person",
                f"{namer.word()} {namer.word()}",
                r,
                born_in=city.id,
                born=rng.randint(1780, 1960),
                occupation=rng.choice(_OCCUPATIONS),
            )
            for city in cities
            for _ in range(cfg.people_per_city)
        ]
        founders = rng.sample(people, min(cfg.companies_per_country, len(people)))
        for founder in founders:
            company = add(
                "company",
                f"{namer.word()} {rng.choice(_COMPANY_SUFFIXES)}",
                r,
                founder=founder.id,
                based_in=rng.choice(cities).id,
                founded=founder.attrs["born"] + rng.randint(22, 55),
            )
            founder.attrs["company"] = company.id
    return ents, num_countries


def _passages(ents: dict[str, Entity], cfg: WorldConfig, rng: random.Random) -> list[dict[str, str]]:
    """One passage per entity (every fact the questions need), plus distractors."""
    name = {e.id: e.name for e in ents.values()}
    by_region: dict[int, list[Entity]] = {}
    for e in ents.values():
        by_region.setdefault(e.region, []).append(e)
    out: list[tuple[str, str]] = []
    for e in ents.values():
        a = e.attrs
        local_cities = [x for x in by_region[e.region] if x.kind == "city"]
        if e.kind == "country":
            rivers = [x.name for x in by_region[e.region] if x.kind == "river"]
            flow = (
                f"The {rivers[0]} river flows" if len(rivers) == 1 else f"The rivers {', '.join(rivers)} flow"
            )
            text = f"{e.name} is a country. Its capital is {name[a['capital']]}. {flow} through {e.name}."
        elif e.kind == "river":
            through = [c.name for c in local_cities if c.attrs["river"] == e.id] or [name[a["country"]]]
            text = f"The {e.name} is a river in {name[a['country']]}. It flows through {', '.join(through)}."
        elif e.kind == "city":
            text = (
                f"{e.name} is a city in {name[a['country']]}, founded in {a['founded']}. "
                f"The {name[a['river']]} river flows through {e.name}."
            )
        elif e.kind == "person":
            text = f"{e.name} was a {a['occupation']} born in {name[a['born_in']]} in {a['born']}."
            if "company" in a:
                text += f" {e.name} founded {name[a['company']]}."
        else:  # company
            text = (
                f"{e.name} is a company based in {name[a['based_in']]}. "
                f"It was founded in {a['founded']} by {name[a['founder']]}."
            )
        out.append((e.name, text))
        if rng.random() < cfg.distractor_rate:
            out.append(_distractor(e, rng, local_cities, name))
    order = list(range(len(out)))
    rng.shuffle(order)  # passage ids carry no information about which entity or split they belong to
    return [{"id": str(i), "contents": make_contents(*out[j])} for i, j in enumerate(order)]


def _distractor(e: Entity, rng: random.Random, cities: list[Entity], name: dict[str, str]) -> tuple[str, str]:
    """A passage that shares the entity's name but states other places and years."""
    year = rng.randint(1100, 1990)
    other = rng.choice([c for c in cities if c.id != e.id] or cities).name
    if e.kind == "country":
        return f"History of {e.name}", f"{e.name} became independent in {year}. Its largest port is {other}."
    if e.kind == "river":
        return (
            f"{e.name} Bridge",
            f"The {e.name} Bridge crosses the {e.name} near {other}. It opened in {year}.",
        )
    if e.kind == "city":
        return f"{e.name} Fair", f"The {e.name} Fair is a market held in {e.name} every year since {year}."
    if e.kind == "person":
        return f"Portrait of {e.name}", f"Portrait of {e.name} is a painting made in {year} in {other}."
    return f"{e.name} Tower", f"The {e.name} Tower is a building in {other}, completed in {year}."


def _value(ents: dict[str, Entity], e: Entity, rel: str) -> tuple[str, str | None]:
    """(answer text, answer entity id or None for literals)."""
    v = e.attrs[rel]
    if isinstance(v, str) and v in ents:
        return ents[v].name, v
    return str(v), None


def _qa(
    qid: str,
    question: str,
    subject: Entity,
    chain: list[tuple[str, str, str]],
    answer_id: str | None,
    bridge_id: str | None = None,
) -> dict[str, Any]:
    """A question record; ``chain`` holds per hop (entity searched, relation, value read)."""
    return {
        "qid": qid,
        "question": question,
        "answer": chain[-1][2],
        "hops": len(chain),
        "relations": [rel for _, rel, _ in chain],
        "region": subject.region,
        "subject": subject.id,
        "subject_name": subject.name,
        "bridge": bridge_id,
        "bridge_name": chain[0][2] if bridge_id else None,
        "answer_entity": answer_id,
        "queries": [s for s, _, _ in chain],
        "needs": [_RELATIONS[rel]["need"].format(s=s) for s, rel, _ in chain],
        "facts": [_RELATIONS[rel]["fact"].format(s=s, o=o) for s, rel, o in chain],
    }


def _questions(ents: dict[str, Entity], cfg: WorldConfig) -> list[dict[str, Any]]:
    qs: list[dict[str, Any]] = []
    for e in ents.values():
        if 1 in cfg.hops:
            for rel in _SINGLE.get(e.kind, []):
                if not cfg.year_questions and rel in _YEAR_RELATIONS:
                    continue
                ans, ans_id = _value(ents, e, rel)
                question = _RELATIONS[rel]["question"].format(s=e.name)
                qs.append(_qa(f"{e.id}.{rel}", question, e, [(e.name, rel, ans)], ans_id))
        if 2 in cfg.hops:
            for kind, r1, r2, template in _CHAINS:
                if e.kind != kind or r1 not in e.attrs:
                    continue
                if not cfg.year_questions and r2 in _YEAR_RELATIONS:
                    continue
                b_name, b_id = _value(ents, e, r1)
                ans, ans_id = _value(ents, ents[b_id], r2)
                if ans_id == e.id:  # "capital of the country where <capital> is" answers with the subject
                    continue
                chain = [(e.name, r1, b_name), (b_name, r2, ans)]
                qs.append(_qa(f"{e.id}.{r1}.{r2}", template.format(s=e.name), e, chain, ans_id, b_id))
    return qs


def _row(q: dict[str, Any], split: str, index: int, seed: int) -> dict[str, Any]:
    """A Search-R1 parquet row; extra_info carries everything the gold demo and the tests need."""
    extra = {
        k: q[k]
        for k in (
            "question",
            "hops",
            "relations",
            "subject",
            "subject_name",
            "bridge",
            "bridge_name",
            "answer_entity",
            "queries",
            "needs",
            "facts",
            "region",
        )
    }
    extra.update(task_id=f"world{seed}-{q['qid']}", split=split, index=index)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": make_prompt(q["question"])}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": [q["answer"]]}},
        "extra_info": extra,
    }


def generate_world(
    seed: int = 0, num_entities: int = 200, name_pool: Sequence[str] | None = None, **overrides: Any
) -> World:
    """Build a world (see the module docstring); ``overrides`` are further :class:`WorldConfig` fields.

    ``name_pool``: the name words to use (e.g. another world's :meth:`World.name_words`), each at most
    once, in an order drawn from ``seed``, instead of words built from the syllable inventory: a world
    with another world's names in other roles and with other facts."""
    cfg = WorldConfig(seed=seed, num_entities=num_entities, **overrides)
    rng = random.Random(seed)
    ents, num_countries = _build_entities(cfg, rng, name_pool)
    corpus = _passages(ents, cfg, rng)
    regions = list(range(num_countries))
    rng.shuffle(regions)
    test_regions = set(regions[: max(1, math.ceil(cfg.test_fraction * num_countries))])
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    questions = _questions(ents, cfg)
    rng.shuffle(questions)
    for q in questions:
        split = "test" if q["region"] in test_regions else "train"
        rows[split].append(_row(q, split, len(rows[split]), seed))
    tasks = {s: [row_to_task(r, i, s) for i, r in enumerate(rs)] for s, rs in rows.items()}
    return World(
        config=cfg, entities=ents, corpus=corpus, train=tasks["train"], test=tasks["test"], rows=rows
    )


# --------------------------------------------------------------------------------------------------------
# Gold demonstrations (SFT bootstrap)

#: how the env wraps retrieved docs after ``</search>`` (Search-R1's rollout)
INFORMATION_TEMPLATE = "\n\n<information>{docs}</information>\n\n"


@dataclass
class Demo:
    """A gold trajectory. ``segments`` are (text, is_model_output): observations get loss_mask 0."""

    text: str
    segments: list[tuple[str, bool]]
    answer: str
    grounded: bool  # every hop's target (bridge name, then answer) occurs in the docs that hop retrieved


def gold_demo(
    task: Task,
    search_fn: Callable[[str], str],
    think: bool = True,
    information_template: str = INFORMATION_TEMPLATE,
) -> Demo:
    """The Search-R1 response a perfect agent writes for ``task`` (a synthetic-world task).

    For each hop: ``<think> I need to find ... </think>\\n<search> {entity name} </search>``, then the
    observation ``information_template.format(docs=search_fn(query).strip())`` exactly as SearchEnv
    appends it,
    and finally ``<think> {fact} </think>\\n<answer> {answer} </answer>``. ``search_fn`` must be the
    retrieval the env uses (e.g. ``RetrievalIndex(...).search_fn(topk=3)``).
    """
    info = task.get("info") or {}
    if not all(k in info for k in ("queries", "needs", "facts", "hops", "bridge_name")):
        raise ValueError(
            f"task {task.get('task_id')!r}: gold_demo needs a synthetic-world task (info.queries/facts)"
        )
    queries, needs, facts = list(info["queries"]), list(info["needs"]), list(info["facts"])
    answer = task["label"][0]
    targets = [*([info["bridge_name"]] if info["hops"] == 2 else []), answer]
    segments: list[tuple[str, bool]] = []
    grounded = True
    for hop, (query, need) in enumerate(zip(queries, needs, strict=True)):
        thought = f"I need to find {need}." if hop == 0 else f"{facts[hop - 1]} Now I need to find {need}."
        prefix = f"<think> {thought} </think>\n" if think else ""
        segments.append((f"{prefix}<search> {query} </search>", True))
        docs = search_fn(query).strip()  # SearchEnv (like Search-R1) strips the rendered docs
        grounded = grounded and targets[hop].lower() in docs.lower()
        segments.append((information_template.format(docs=docs), False))
    prefix = f"<think> {facts[-1]} </think>\n" if think else ""
    segments.append((f"{prefix}<answer> {answer} </answer>", True))
    return Demo(text="".join(s for s, _ in segments), segments=segments, answer=answer, grounded=grounded)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="Write a synthetic Search-R1 world (corpus.jsonl, train/test.parquet)."
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-entities", type=int, default=WorldConfig.model_fields["num_entities"].default)
    p.add_argument("--num-syllables", type=int, default=WorldConfig.model_fields["num_syllables"].default)
    p.add_argument(
        "--distractor-rate", type=float, default=WorldConfig.model_fields["distractor_rate"].default
    )
    p.add_argument("--hops", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    a = p.parse_args(argv)
    world = generate_world(
        a.seed, a.num_entities, num_syllables=a.num_syllables, distractor_rate=a.distractor_rate, hops=a.hops
    )
    paths = world.write(a.out)
    print(
        json.dumps(
            {
                "out": str(Path(a.out)),
                "digest": world.digest(),
                **world.stats(),
                "files": {k: str(v) for k, v in paths.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
