"""Bootstrap for the CPU demo: a synthetic world, a tiny model with a tokenizer trained on it, and an SFT
warm start on gold search-and-answer demonstrations, cached so that a second run skips all of it.

Steps (each keyed by a hash of the config, so changing the config rebuilds only what depends on it):

1. ``world/``: :func:`generate_world` writes ``corpus.jsonl``, ``train.parquet``, ``test.parquet``: the
   world RL trains on (train split) and is evaluated on (test split).
2. ``base/``: :func:`agentrl.models.tiny.build_tiny_model` trains a byte-level BPE tokenizer on the world's
   text plus the Search-R1 prompt and writes a random model (a standard HF directory).
3. ``sft/``: a short supervised warm start on :func:`gold_demo` trajectories from *practice worlds*: worlds
   generated with other seeds, each with its own retrieval index, whose names are either built from the
   same syllable inventory (``sft.practice_names: inventory``) or the evaluation world's own name words
   put in other roles, with other facts (``world``). Every practice world states its own random facts, so
   a tiny model cannot lower the loss by memorising facts and has to learn to copy names out of the
   question and the retrieved passages, the skill the held-out split tests. The warm start never sees a
   fact of the evaluation world. With ``world`` names, the names it copies are the very tokens held-out
   answers are made of (most are one token of the world's tokenizer), and the copy skill comes several
   times sooner than with inventory names (mostly several tokens each). Demonstrations are tokenized
   exactly the way the orchestrator builds a rollout (chat-templated prompt, then each model segment and
   each observation tokenized on its own). The loss is cross-entropy on the model's tokens plus
   ``lm_weight`` times a language-model loss on every token (prompt and retrieved passages too): the
   repeated names in those passages are where a small model learns to copy fastest. Each batch is sorted
   by length and run in ``micro_batches`` chunks (gradient accumulation of one normalized loss), which
   cuts padding.
4. Optionally (``sft.search_prob``; the demo's config sets 0.35), the SFT model's *first action* is
   calibrated: a few steps of a soft-label loss on the first response token only, so that it opens with
   ``<search>`` with probability ``p`` and with ``<answer>`` otherwise. With ``p < 0.5`` greedy decoding
   never searches, so the calibrated model scores about 0 by construction: a warm start deliberately weak
   at one skill, searching, which RL gives back (while sampling, it still searches with probability about
   ``p``, and reads and copies as the SFT taught it).

The SFT loop here is plain PyTorch on the transformers model: the warm start is a fixed preprocessing
step of this example, not part of the training system (``agentrl.trainer`` also has an SFT loss mode for
users who warm-start with Megatron).
"""

from __future__ import annotations

import gc
import hashlib
import json
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from agentrl.config import ConfigModel
from agentrl.sft import SFTConfig as LoopConfig

from .data import make_prompt
from .retrieval_server import RetrievalIndex
from .world import WORLD_FORMAT_VERSION, World, WorldConfig, generate_world, gold_demo


class TinyModelConfig(ConfigModel):
    """Shape of the demo model (any transformers Qwen2/Qwen3/Llama shape works, or a Qwen3-MoE one)."""

    arch: str = Field("qwen2", description="qwen2, qwen3, llama or qwen3_moe (mixture of experts)")
    vocab_size: int = Field(2048, ge=300, description="BPE vocabulary size")
    hidden_size: int = Field(128, ge=16, description="model width")
    num_hidden_layers: int = Field(4, ge=1, description="transformer layers")
    num_attention_heads: int = Field(4, ge=1, description="query heads")
    num_key_value_heads: int = Field(2, ge=1, description="key/value heads (GQA)")
    intermediate_size: int = Field(384, ge=16, description="SwiGLU width")
    seed: int = Field(0, description="init seed")
    num_experts: int | None = Field(None, ge=1, description="qwen3_moe: experts per layer (default 8)")
    num_experts_per_tok: int | None = Field(
        None, ge=1, description="qwen3_moe: experts per token, top-k (default 2)"
    )
    moe_intermediate_size: int | None = Field(
        None, ge=16, description="qwen3_moe: SwiGLU width of each expert (default hidden_size)"
    )

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        # unset MoE fields are left out: a dense shape's dump (the cache keys, the model build) is as before
        kwargs.setdefault("exclude_none", True)
        return super().model_dump(**kwargs)


class SFTConfig(LoopConfig):
    """The supervised warm start on gold demonstrations: the SFT loop's optimisation (the fields of
    agentrl.sft.SFTConfig, some with the demo's defaults), how its demonstrations are made, and the
    first action's calibration."""

    hold_until_accuracy: float | None = Field(
        None,
        gt=0,
        le=1,
        description="wsd: where the decay would start, hold the peak rate on until the first token of the "
        "demonstrations' answers is predicted right this often (greedy, teacher-forced, on the training "
        "batches, over the last probe_window steps: the copy skill), then decay as usual, at most "
        "max_steps_factor × steps in all; null: the fixed schedule",
    )
    probe_window: int = Field(50, ge=1, description="steps the answer accuracy is measured over")
    lm_weight: float = Field(
        3.0, ge=0, description="weight of the language-model loss on every token (0: model tokens only)"
    )
    micro_batches: int = Field(
        2, ge=1, description="each batch is sorted by length and run in this many chunks (less padding)"
    )
    seed: int = Field(0, description="data order and dropout seed")
    max_demos: int = Field(30000, ge=1, description="demonstrations kept at most (a random subset)")
    practice_worlds: int = Field(20, ge=1, description="practice worlds the demonstrations come from")
    practice_entities: int = Field(500, ge=10, description="entities per practice world")
    think: bool = Field(True, description="include <think> reasoning in the demonstrations")
    search_prob: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="after SFT, calibrate the first response token to open with <search> with this "
        "probability, else <answer> (a reluctant searcher; needs think: false); null: no calibration",
    )
    calibration_steps: int = Field(100, ge=1, description="optimizer steps of that calibration")
    calibration_lr: float = Field(1e-3, gt=0, description="Adam learning rate of that calibration")
    calibration_keep: float = Field(
        0.0,
        ge=0,
        description="weight of the SFT loss on a batch of demonstrations (their tokens after the first "
        "action) in every calibration step: it holds how the model searches, reads and copies where the "
        "SFT left it while the first action moves; 0: the first action's loss alone",
    )
    practice_names: Literal["inventory", "world"] = Field(
        "inventory",
        description="names of the practice worlds: built from the evaluation world's syllable inventory, or "
        "the evaluation world's own name words in other roles with other facts (the copy skill comes sooner)",
    )
    answer_loss: bool = Field(
        True,
        description="train on the words inside <answer> (and inside searches after the first); false: a "
        "format-only warm start that teaches the tags and when to search or answer, but gives no gradient "
        "toward what to answer (needs lm_weight: 0, which would train on every token)",
    )
    answer_weight: float = Field(
        0.0,
        ge=0,
        description="extra weight of the tokens inside <answer> in the SFT loss (each counts 1 + this): the "
        "answer is the few tokens a demonstration copies out of the passages, and their gradient brings the "
        "copy skill sooner",
    )

    @model_validator(mode="after")
    def _check(self) -> SFTConfig:
        if self.search_prob is not None and self.think:
            raise ValueError("search_prob calibrates the first response token, so it needs think: false")
        if not self.answer_loss and self.lm_weight:
            raise ValueError("answer_loss: false needs lm_weight: 0 (the LM term trains on every token)")
        return self


class BootstrapConfig(ConfigModel):
    """Everything the demo needs before RL starts."""

    cache_dir: str = Field(".cache/search_r1", description="where bootstrap artifacts are cached")
    world: WorldConfig = Field(default_factory=WorldConfig, description="synthetic world")
    model: TinyModelConfig = Field(default_factory=TinyModelConfig, description="tiny model shape")
    base_model: str | None = Field(
        None,
        description="warm-start this HF model dir or 'pretrained:NAME' (its own tokenizer) instead of a "
        "tiny model built for the world; 'model' is then unused",
    )
    sft: SFTConfig = Field(default_factory=SFTConfig, description="warm start")
    topk: int = Field(3, ge=1, description="passages per search (must match the env)")


@dataclass
class BootstrapResult:
    world_dir: Path
    corpus_path: Path
    base_model_dir: Path
    sft_model_dir: Path
    cached: bool
    seconds: float


def _key(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _done(path: Path) -> bool:
    return (path / "DONE").is_file()


def _mark_done(path: Path, info: dict[str, Any]) -> None:
    (path / "DONE").write_text(json.dumps(info, indent=2))


_CONTENT = re.compile(r"(<(search|answer)>)(.*?)(</\2>)", re.DOTALL)


def _model_pieces(text: str, first_search: bool, answer_loss: bool) -> list[tuple[str, bool]]:
    """A model segment as (text, trained) pieces. With ``answer_loss`` off, the words inside ``<answer>``
    and inside a search that is not the first are not trained (they would teach copying from passages);
    the tags and everything else are."""
    if answer_loss:
        return [(text, True)]
    m = _CONTENT.search(text)
    if m is None or (m.group(2) == "search" and first_search):
        return [(text, True)]
    return [(text[: m.end(1)], True), (m.group(3), False), (text[m.start(4) :], True)]


def _weigh_answers(ids: list[int], mask: list[float], tags: tuple[int, int], extra: float) -> list[float]:
    """``mask`` with ``1 + extra`` on the trained tokens between an ``<answer>`` and its ``</answer>`` id."""
    out, inside = [], False
    for tok, m in zip(ids, mask, strict=True):
        inside = inside and tok != tags[1]
        out.append(m * (1.0 + extra) if inside else m)
        inside = inside or tok == tags[0]
    return out


def demo_token_rows(
    tokenizer: Any,
    tasks: list[dict[str, Any]],
    search_fn: Any,
    think: bool,
    answer_loss: bool = True,
    answer_weight: float = 0.0,
) -> list[dict[str, list[Any]]]:
    """Gold demonstrations as (input_ids, loss_mask, probe_mask) rows, tokenized the way a rollout is
    built; with ``answer_weight`` the loss mask weighs the answer's tokens ``1 + answer_weight``. The probe
    mask marks each answer's first token (what ``hold_until_accuracy`` watches)."""
    tags = (tokenizer.convert_tokens_to_ids("<answer>"), tokenizer.convert_tokens_to_ids("</answer>"))
    demos: list[list[tuple[str, bool]]] = []  # each row's (text, trained) pieces, its prompt first
    for task in tasks:
        demo = gold_demo(task, search_fn, think=think)
        if not demo.grounded:
            continue  # retrieval missed the needed passage: the demo would teach guessing
        prompt = [{"role": "user", "content": make_prompt(task["prompt"])}]
        pieces = [(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False), False)]
        turn = 0
        for text, is_model in demo.segments:
            pieces += _model_pieces(text, turn == 0, answer_loss) if is_model else [(text, False)]
            turn += int(is_model)
        demos.append(pieces)
    # one tokenizer call for the distinct pieces (passages repeat across tasks): the same ids as a call a
    # piece, without a call's overhead each
    unique = list(dict.fromkeys(text for pieces in demos for text, _ in pieces))
    encoded = tokenizer(unique, add_special_tokens=False)["input_ids"] if unique else []
    ids_of = dict(zip(unique, encoded, strict=True))
    rows = []
    for pieces in demos:
        ids: list[int] = []
        mask: list[int] = []
        for text, trained in pieces:
            seg = ids_of[text]
            ids += seg
            mask += [1 if trained else 0] * len(seg)
        weights = _weigh_answers(ids, mask, tags, answer_weight) if answer_weight else mask
        probe = [int(prev == tags[0]) for prev in [None, *ids[:-1]]]  # each answer's first token
        rows.append({"input_ids": ids, "loss_mask": weights, "probe_mask": probe})
    return rows


def practice_worlds(cfg: BootstrapConfig) -> Iterator[World]:
    """The practice worlds, one at a time: same name pieces as the evaluation world, no shared entity.

    Practice world ``k`` is the evaluation world's config with seed ``seed + 1000 + k``, ``name_seed`` pinned
    to the evaluation world's, and ``practice_entities`` entities; with ``sft.practice_names: world`` its
    names are the evaluation world's name words (:meth:`World.name_words`), drawn in the practice world's
    own order.
    """
    w = cfg.world
    pool = generate_world(**w.model_dump()).name_words() if cfg.sft.practice_names == "world" else None
    for k in range(cfg.sft.practice_worlds):
        yield generate_world(
            **w.model_dump()
            | {
                "seed": w.seed + 1000 + k,
                "num_entities": cfg.sft.practice_entities,
                "name_seed": w.inventory_seed,
            },
            name_pool=pool,
        )


def vocab_texts(worlds: list[World]) -> list[str]:
    """What the demo's BPE tokenizer is trained on: the worlds' passages and questions, and a prompt."""
    return [t for w in worlds for t in w.corpus_text() + w.questions_for_vocab()] + [make_prompt("x")]


def practice_rows(tokenizer: Any, cfg: BootstrapConfig) -> list[dict[str, list[int]]]:
    """Gold demonstrations from the practice worlds (:func:`practice_worlds`), questions of both splits."""
    rows: list[dict[str, list[int]]] = []
    for world in practice_worlds(cfg):
        index = RetrievalIndex(world.corpus)  # in memory: practice worlds are never written to disk
        try:
            rows += demo_token_rows(
                tokenizer,
                world.train + world.test,
                index.search_fn(topk=cfg.topk),
                cfg.sft.think,
                cfg.sft.answer_loss,
                cfg.sft.answer_weight,
            )
        finally:
            index.close()
    random.Random(cfg.sft.seed).shuffle(rows)
    return rows[: cfg.sft.max_demos]


def sft(
    model_dir: Path, out_dir: Path, rows: list[dict[str, list[int]]], cfg: SFTConfig, log: Any = print
) -> dict[str, float]:
    """Cross-entropy on loss_mask-1 tokens (the generic loop, :func:`agentrl.sft.train_rows`), then the
    first-action calibration when ``search_prob`` asks for it; writes an HF directory to ``out_dir``."""
    import torch

    from agentrl.sft import load_model, save_model, train_rows

    model, tok = load_model(model_dir, cfg)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    stats = train_rows(model, rows, cfg, pad, lambda line: log(f"bootstrap: {line}"))
    if cfg.search_prob is not None:
        stats.update(calibrate_first_action(model, tok, rows, cfg))
        log(f"bootstrap: first action calibrated: <search> with p = {stats['sft/search_prob']:.2f}")
    save_model(model, tok, model_dir, out_dir)
    if str(cfg.device).startswith("cuda"):  # hand the GPU memory back: the engine and trainer start next
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return stats


def calibrate_first_action(
    model: Any, tokenizer: Any, rows: list[dict[str, list[int]]], cfg: SFTConfig, batch_size: int = 32
) -> dict[str, float]:
    """Make the model open its response with ``<search>`` with probability ``cfg.search_prob``, else
    ``<answer>``.

    A soft-label cross-entropy on the first response token only (target ``p`` on ``<search>``, ``1 - p`` on
    ``<answer>``), a few Adam steps at a small learning rate: how to search, read and copy stays as the SFT
    left it; only the habit of searching changes. With ``p < 0.5`` greedy decoding never searches, while
    sampling at temperature 1 still searches with probability about ``p``: the reluctant searcher that
    Search-R1's RL turns into one that searches. Returns the mean ``P(<search>)`` it ends with (measured on
    the last batches).

    With ``cfg.calibration_keep`` above 0 each step also takes the SFT loss (loss-masked cross-entropy) on
    ``cfg.batch_size`` demonstrations, their first action's token left out, times that weight: the first
    action's loss alone, through weights every position shares, also moves what comes after it (how the
    model reads passages and copies a name out of them); the kept loss holds that where the SFT left it.
    """
    import torch

    from agentrl.sft import right_pad

    ids = {}
    for name in ("<search>", "<answer>"):
        tok_ids = tokenizer(name, add_special_tokens=False)["input_ids"]
        if len(tok_ids) != 1:
            raise ValueError(f"calibration needs {name} to be one token, got {tok_ids}")
        ids[name] = tok_ids[0]
    target = torch.zeros(model.config.vocab_size)
    target[ids["<search>"]] = cfg.search_prob
    target[ids["<answer>"]] = 1.0 - cfg.search_prob
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = [r["input_ids"][: r["loss_mask"].index(1)] for r in rows]
    rng = random.Random(cfg.seed + 1)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.calibration_lr)
    model.train()
    seen: list[float] = []
    dev = next(model.parameters()).device
    target = target.to(dev)
    for _ in range(cfg.calibration_steps):
        batch = rng.sample(prompts, min(batch_size, len(prompts)))
        attn = right_pad([[1] * len(p) for p in batch], 0).to(dev)
        last = torch.tensor([len(p) - 1 for p in batch], device=dev)
        logits = model(input_ids=right_pad(batch, pad).to(dev), attention_mask=attn).logits
        logits = logits[torch.arange(len(batch), device=dev), last].float()
        logp = torch.log_softmax(logits, dim=-1)
        loss = -(target * logp).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        if cfg.calibration_keep:
            loss = loss + cfg.calibration_keep * _kept_loss(model, rng.sample(rows, cfg.batch_size), pad, dev)
        loss.backward()
        opt.step()
        seen.append(logp[:, ids["<search>"]].exp().mean().item())
    tail = seen[-10:]
    return {"sft/search_prob": sum(tail) / len(tail)}


def _kept_loss(model: Any, rows: list[dict[str, list[Any]]], pad: int, dev: Any) -> Any:
    """The SFT loss of ``rows`` without each row's first trained token, the first action: what
    :func:`calibrate_first_action` keeps while it moves that token. Normalised as the SFT normalises it
    (:func:`agentrl.sft.train_rows`): weighted by the loss mask, over the trained tokens' count."""
    from agentrl.sft import token_nll

    kept = []
    for r in rows:
        mask = list(r["loss_mask"])
        mask[mask.index(1)] = 0
        kept.append({"input_ids": r["input_ids"], "loss_mask": mask})
    nll, mask, _ = token_nll(model, kept, pad, dev)
    return (nll * mask).sum() / (mask > 0).sum().clamp(min=1)


def world_dir_of(cfg: BootstrapConfig) -> Path:
    """Where the world of ``cfg`` is cached (its key covers the world config and the format version)."""
    return Path(cfg.cache_dir) / f"world-{_key(WORLD_FORMAT_VERSION, cfg.world.model_dump())}"


def build_world(cfg: BootstrapConfig, log: Any = print) -> Path:
    """Only the synthetic world (corpus + tasks), cached: what a run with a real model needs."""
    world_dir = world_dir_of(cfg)
    if not _done(world_dir):
        log("bootstrap: generating the synthetic world")
        world = generate_world(**cfg.world.model_dump())
        world_dir.mkdir(parents=True, exist_ok=True)
        world.write(world_dir)
        _mark_done(world_dir, world.stats())
    return world_dir


def bootstrap(cfg: BootstrapConfig, log: Any = print) -> BootstrapResult:
    """Build (or reuse from the cache) the world, the base model and the SFT warm start."""
    from agentrl.models.tiny import build_tiny_model

    t0 = time.monotonic()
    root = Path(cfg.cache_dir)
    world_key = _key(WORLD_FORMAT_VERSION, cfg.world.model_dump())
    world_dir = world_dir_of(cfg)
    if cfg.base_model is not None:
        from agentrl.models.pretrained import resolve_model_path

        base_dir = Path(resolve_model_path(cfg.base_model))
        shape: Any = cfg.base_model
    else:
        base_dir = root / f"base-{_key(world_key, cfg.model.model_dump())}"
        shape = cfg.model.model_dump()
    sft_dir = root / f"sft-{_key(world_key, shape, cfg.sft.model_dump(), cfg.topk)}"
    cached = _done(sft_dir)
    if cached:
        log(f"bootstrap: cached SFT model at {sft_dir}")
        return BootstrapResult(
            world_dir, world_dir / "corpus.jsonl", base_dir, sft_dir, True, time.monotonic() - t0
        )

    build_world(cfg, log)
    if cfg.base_model is None and not _done(base_dir):
        log("bootstrap: training the tokenizer and writing the tiny base model")
        world = generate_world(**cfg.world.model_dump())
        build_tiny_model(base_dir, vocab_corpus=vocab_texts([world]), **cfg.model.model_dump())
        _mark_done(base_dir, cfg.model.model_dump())
    import transformers

    log(f"bootstrap: SFT warm start on {cfg.sft.practice_worlds} practice worlds")
    tok = transformers.AutoTokenizer.from_pretrained(base_dir)
    rows = practice_rows(tok, cfg)
    if not rows:
        raise RuntimeError("bootstrap: no grounded demonstrations; check the world and retrieval config")
    stats = sft(base_dir, sft_dir, rows, cfg.sft, log)
    stats["bootstrap/seconds"] = time.monotonic() - t0  # world, base model and SFT
    _mark_done(sft_dir, stats)
    log(f"bootstrap: SFT done ({stats['sft/demos']:.0f} demos, final loss {stats['sft/final_loss']:.3f})")
    return BootstrapResult(
        world_dir, world_dir / "corpus.jsonl", base_dir, sft_dir, False, time.monotonic() - t0
    )
