"""Supervised warm start from demonstrations: a model that makes well-formed tool calls before RL starts.

A randomly initialised or small model rarely writes a whole tool call (about 25 exact tokens) by chance,
so RL on a new tool env sees no call to reinforce. A few hundred steps of supervised training on
demonstrations fixes that. A demonstration is one chat conversation in the OpenAI message format, a JSON
object per line of a JSONL file::

    {"messages": [{"role": "user", "content": "Convert 3 km to m."},
                  {"role": "assistant", "content": "<tool_call>\\n{...}\\n</tool_call>"},
                  {"role": "tool", "content": "3000"},
                  {"role": "assistant", "content": "3000 m"}],
     "tools": [{"type": "function", "function": {...}}]}

An assistant message is trained on as the model would sample it: its ``content``, or, for a message with
OpenAI ``tool_calls``, the text the model's chat template renders for it, followed by the template's
end-of-turn token. :func:`record_demos` writes such conversations by running an env with a scripted policy.

:class:`DemoRenderer` turns a conversation into ``(input_ids, loss_mask)`` exactly as the rollout builds
an episode (:mod:`agentrl.chat`): the messages before the first assistant turn rendered once with
``prompt_ids`` (and the env's tool schemas), each assistant turn's ids (loss_mask 1), and the messages
between two assistant turns as one observation, ``observation_messages_ids`` (loss_mask 0). The loss is
cross-entropy on the assistant tokens (plus, optionally, ``lm_weight`` times a language-model loss on all
tokens). The result is a standard HF model directory that ``model_path`` can name::

    python -m agentrl.sft --demos demos.jsonl --model pretrained:smollm2-135m-instruct --out runs/sft
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from agentrl.chat import ChatTemplateError, ChatTokenizer
from agentrl.config import ConfigModel

Message = dict[str, Any]
# {"input_ids": [...], "loss_mask": [...]}: one tokenized demonstration; loss_mask 1 trains a token, 0 not,
# and a weight above 0 trains it with that weight; an optional "probe_mask" (1/0) marks the tokens whose
# next-token accuracy SFTConfig.hold_until_accuracy watches
Row = dict[str, list[Any]]

_MARK = "\u2063AGENTRL_SFT_MARK\u2063"
_USER: list[Message] = [{"role": "user", "content": "u"}]


class SFTConfig(ConfigModel):
    """The supervised warm start's optimisation (AdamW, a 5% warm-up, then cosine or warmup-stable-decay)."""

    steps: int = Field(300, ge=0, description="optimizer steps")
    batch_size: int = Field(16, ge=1, description="demonstrations per step")
    lr: float = Field(2e-3, gt=0, description="AdamW peak learning rate (5% warm-up, then the schedule)")
    schedule: Literal["cosine", "wsd"] = Field(
        "cosine",
        description="after the warm-up: cosine decay to 0, or wsd (the peak rate held, then a linear "
        "decay to 0 over the last decay_fraction of the steps)",
    )
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: share of the steps spent decaying")
    hold_until_accuracy: float | None = Field(
        None,
        gt=0,
        le=1,
        description="wsd: where the decay would start, hold the peak rate on until the probe tokens' "
        "next-token accuracy (the rows' probe_mask; greedy, on the training batches, over the last "
        "probe_window steps) reaches this, then decay as usual: a skill that forms late gets the steps it "
        "needs, at most max_steps_factor × steps in all; null: the fixed schedule",
    )
    max_steps_factor: float = Field(
        1.5,
        ge=1,
        description="with hold_until_accuracy: the most steps, the decay included, as a multiple of steps",
    )
    probe_window: int = Field(50, ge=1, description="steps the probe accuracy is measured over")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    lm_weight: float = Field(
        0.0, ge=0, description="weight of a language-model loss on every token (0: assistant tokens only)"
    )
    micro_batches: int = Field(
        1, ge=1, description="each batch is sorted by length and run in this many chunks (less padding)"
    )
    device: str = Field("cpu", description="where the SFT runs: cpu or cuda")
    seed: int = Field(0, description="data order seed (and torch's)")

    @model_validator(mode="after")
    def _check_hold(self) -> SFTConfig:
        check_hold(self)
        return self


def check_hold(cfg: Any) -> None:
    """A ValueError naming the field when ``hold_until_accuracy`` cannot apply (shared with configs that
    carry the same fields)."""
    if cfg.hold_until_accuracy is None:
        return
    if cfg.schedule != "wsd":
        raise ValueError("hold_until_accuracy holds wsd's peak rate: it needs schedule: wsd")


# ---- demonstrations: conversations in, token rows out ---------------------------------------------------
class DemoRenderer:
    """Tokenizes demonstrations the way the rollout tokenizes episodes (see the module docstring)."""

    def __init__(self, chat: ChatTokenizer) -> None:
        self.chat = chat
        self._gen_prefix = self._render(_USER, add_generation_prompt=True)
        marked = self._render([*_USER, {"role": "assistant", "content": _MARK}], add_generation_prompt=False)
        if not marked.startswith(self._gen_prefix) or marked.count(_MARK) != 1:
            raise ChatTemplateError(
                "the chat template does not render an assistant turn right after its generation prompt"
            )
        # what the template puts after assistant content ("<|im_end|>\n"): its first token is the
        # end-of-turn token the model samples; the rest belongs to the next observation's delta
        self._tail = marked.split(_MARK, 1)[1]
        tail_ids = chat.encode(self._tail)
        if not tail_ids or tail_ids[0] not in chat.eot_ids:
            raise ChatTemplateError("the chat template ends an assistant turn without an end-of-turn token")
        self.eot_id = tail_ids[0]

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        out = self.chat.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not isinstance(out, str):
            raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}")
        return out

    def assistant_text(self, message: Message) -> str:
        """The text the model samples for ``message`` (its end-of-turn token left out): ``content`` as it
        is, or, when the message has ``tool_calls``, the template's rendering of the whole message."""
        if not message.get("tool_calls"):
            content = message.get("content")
            if not isinstance(content, str):
                raise ValueError(f"an assistant message needs 'content' text or 'tool_calls': {message!r}")
            return content
        full = self._render([*_USER, message], add_generation_prompt=False)
        if not full.startswith(self._gen_prefix) or not full.endswith(self._tail):
            raise ChatTemplateError("the chat template renders this assistant message around other text")
        return full[len(self._gen_prefix) : len(full) - len(self._tail)]

    def row(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> Row:
        """``input_ids`` and ``loss_mask`` of one conversation: what the rollout would hold after sampling
        its assistant turns. Messages after the last assistant turn are left out (nothing follows them)."""
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
        if first is None:
            raise ValueError("a demonstration needs at least one assistant message")
        ids = self.chat.prompt_ids(messages[:first], tools)
        mask = [0] * len(ids)
        pending: list[Message] = []  # the observation messages since the last assistant turn
        for msg in messages[first:]:
            if msg.get("role") != "assistant":
                pending.append(msg)
                continue
            if pending:
                obs = self.chat.observation_messages_ids(pending, ids[-1])
                ids += obs
                mask += [0] * len(obs)
                pending = []
            turn = [*self.chat.encode(self.assistant_text(msg)), self.eot_id]
            ids += turn
            mask += [1] * len(turn)
        return {"input_ids": ids, "loss_mask": mask}


def read_demos(path: str | Path) -> list[dict[str, Any]]:
    """Conversations from a JSONL file: each line ``{"messages": [...], "tools": [...]}`` (``tools``
    optional). A bad line fails with the file and line number."""
    demos = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                demo = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not JSON: {err}") from None
            if not isinstance(demo, dict) or not isinstance(demo.get("messages"), list):
                raise ValueError(f"{path}:{lineno}: a demonstration is an object with a 'messages' list")
            demos.append(demo)
    return demos


def write_demos(path: str | Path, demos: Iterable[dict[str, Any]]) -> Path:
    """Write conversations as JSONL (one ``{"messages", "tools"}`` object a line); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for demo in demos:
            f.write(json.dumps(demo) + "\n")
    return path


Policy = Callable[[dict[str, Any], list[Message]], "str | Awaitable[str]"]


async def record_demos(
    env_factory: Callable[[], Any], tasks: Iterable[dict[str, Any]], policy: Policy, max_turns: int = 8
) -> list[dict[str, Any]]:
    """Demonstrations from a scripted policy: for each task, ``env.reset``, then ``policy(task, messages)``
    (sync or async) writes each assistant turn as the model should (tool calls in the env's format), the
    env steps on it, and its observations (``StepResult.messages``, else ``observation``) join the
    conversation. Episodes that do not end with ``terminated`` within ``max_turns`` are left out: a
    demonstration the env did not accept would teach the wrong thing."""
    demos = []
    for task in tasks:
        env = env_factory()
        try:
            conversation = [dict(m) for m in await env.reset(dict(task))]
            done = False
            for _ in range(max_turns):
                action = policy(task, conversation)
                if inspect.isawaitable(action):
                    action = await action
                conversation.append({"role": "assistant", "content": action})
                res = await env.step(action)
                if res.terminated or res.truncated:
                    done = res.terminated
                    break
                if getattr(res, "observation_format", "message") != "message":
                    raise ValueError("record_demos: raw observations cannot be written as chat messages")
                if res.messages:
                    conversation += [dict(m) for m in res.messages]
                elif res.observation:
                    conversation.append({"role": res.observation_role, "content": res.observation})
        finally:
            await env.close()
        if done:
            demo: dict[str, Any] = {"messages": conversation}
            if getattr(env, "tools", None):
                demo["tools"] = env.tools
            demos.append(demo)
    return demos


def demo_rows(tokenizer: Any, demos: Iterable[dict[str, Any]]) -> list[Row]:
    """Token rows of ``demos`` for a HF tokenizer with a chat template (see :class:`DemoRenderer`)."""
    renderer = DemoRenderer(ChatTokenizer(tokenizer))
    rows = []
    for i, demo in enumerate(demos):
        try:
            rows.append(renderer.row(demo["messages"], demo.get("tools")))
        except (ValueError, KeyError) as err:
            raise ValueError(f"demonstration {i}: {err}") from err
    return rows


# ---- training ----------------------------------------------------------------------------------------
def right_pad(seqs: list[list[int]], value: int) -> Any:
    """A ``[len(seqs), longest]`` long tensor: each sequence followed by ``value`` up to the longest."""
    import torch

    n = max(len(x) for x in seqs)
    return torch.tensor([list(x) + [value] * (n - len(x)) for x in seqs])


def decay_steps(cfg: SFTConfig) -> int:
    """wsd: the steps of the decay (``decay_fraction`` of ``steps``)."""
    return max(1, round(cfg.decay_fraction * cfg.steps))


def lr_at(step: int, cfg: SFTConfig, decay_start: int | None = None) -> float:
    """The learning rate of ``step``: a linear warm-up over 5% of the steps, then the schedule. wsd's
    decay starts at ``decay_start`` (default: where it ends at ``steps``)."""
    warm = max(1, cfg.steps // 20)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.schedule == "wsd":
        decay = decay_steps(cfg)
        start = cfg.steps - decay if decay_start is None else decay_start
        return cfg.lr * min(1.0, (start + decay - step) / decay)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, cfg.steps - warm)))


def token_nll(model: Any, rows: list[Row], pad_id: int, device: Any) -> tuple[Any, Any, Any]:
    """One forward of ``rows`` (right-padded): each token's negative log-likelihood given the ones before
    it, ``[len(rows), longest - 1]``, with the rows' loss masks and attention masks over the same
    positions (float, 0 at padding)."""
    nll, mask, attn, _ = _token_scores(model, rows, pad_id, device, probe=False)
    return nll, mask, attn


def _token_scores(
    model: Any, rows: list[Row], pad_id: int, device: Any, probe: bool
) -> tuple[Any, Any, Any, tuple[float, float]]:
    """:func:`token_nll`'s three, and with ``probe`` (probe tokens predicted right, probe tokens): the
    greedy next-token hits on the tokens the rows' ``probe_mask`` marks ((0, 0) without)."""
    import torch

    ids = right_pad([r["input_ids"] for r in rows], pad_id).to(device)
    mask = right_pad([r["loss_mask"] for r in rows], 0).float().to(device)
    attn = right_pad([[1] * len(r["input_ids"]) for r in rows], 0).to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    # each position scored against the next token, the last against nothing (ignored): the whole logits
    # tensor goes in as it is, no copy of a shifted slice
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    nll = torch.nn.functional.cross_entropy(
        logits.view(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view(len(rows), -1)[:, :-1]
    hits = (0.0, 0.0)
    if probe:
        with torch.no_grad():
            marked = right_pad([r.get("probe_mask") or [0] for r in rows], 0).bool().to(device)
            marked = torch.nn.functional.pad(marked, (0, ids.shape[1] - marked.shape[1]))[:, 1:]
            # the greedy guess at the marked positions only: an argmax over the vocabulary is not cheap
            right = logits[:, :-1][marked].argmax(-1) == ids[:, 1:][marked]
            hits = (float(right.sum().item()), float(marked.sum().item()))
    return nll, mask[:, 1:], attn[:, 1:], hits


def train_rows(
    model: Any, rows: list[Row], cfg: SFTConfig, pad_id: int, log: Callable[[str], Any] = print
) -> dict[str, float]:
    """Train ``model`` (a transformers causal LM, in place) on ``rows``: cross-entropy on the trained tokens
    (loss_mask above 0, each weighted by its loss_mask value; 1 in every row a renderer makes), normalised by
    their count in the batch, plus ``lm_weight`` times the mean loss on every token.
    Batches are drawn from reshuffled passes over the rows (seeded), sorted by length and run in
    ``micro_batches`` chunks (gradient accumulation of one normalised loss). With ``hold_until_accuracy``
    the wsd decay starts once the probe tokens' accuracy reaches it (:class:`_HeldDecay`), so the step
    count is the schedule's. Returns ``sft/...`` figures."""
    import torch

    rng = random.Random(cfg.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    losses: list[float] = []
    order: list[int] = []
    held = _HeldDecay(cfg, rows) if cfg.hold_until_accuracy is not None else None
    step = 0
    while step < (held.end if held else cfg.steps):
        if len(order) < cfg.batch_size:
            perm = list(range(len(rows)))
            rng.shuffle(perm)
            order += perm
        batch = sorted((rows[order.pop()] for _ in range(cfg.batch_size)), key=lambda r: len(r["input_ids"]))
        n_model = sum(sum(1 for m in r["loss_mask"][1:] if m) for r in batch)
        n_all = sum(len(r["input_ids"]) - 1 for r in batch)
        opt.zero_grad(set_to_none=True)
        loss_value = 0.0
        size = -(-len(batch) // cfg.micro_batches)
        hits = [0.0, 0.0]
        for chunk in (batch[i : i + size] for i in range(0, len(batch), size)):
            nll, mask, attn, (right, marked) = _token_scores(model, chunk, pad_id, cfg.device, bool(held))
            hits = [hits[0] + right, hits[1] + marked]
            loss = (nll * mask).sum() / max(1, n_model)
            if cfg.lm_weight:
                loss = loss + cfg.lm_weight * (nll * attn).sum() / n_all
            loss.backward()
            loss_value += loss.item()
            del mask, attn, nll, loss  # the GPU memory of a long chunk, before the next one
        if held:
            held.observe(step, *hits)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, held.start if held else None)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss_value)
        step += 1
        total = held.end if held else cfg.steps
        if step % 100 == 0 or step == total:
            recent = losses[-100:]
            probe = f" probe accuracy {held.accuracy():.3f}" if held else ""
            log(f"sft: step {step}/{total} loss {sum(recent) / len(recent):.3f}{probe}")
    tail = losses[-20:] or [float("nan")]
    stats = {"sft/final_loss": sum(tail) / len(tail), "sft/steps": float(step), "sft/demos": float(len(rows))}
    if held:
        stats |= {"sft/decay_start": float(held.start), "sft/probe_accuracy": held.accuracy()}
    return stats


class _HeldDecay:
    """wsd with ``hold_until_accuracy``: the decay's start, moved on one step at a time from where the fixed
    schedule puts it while the probe tokens' accuracy over the last ``probe_window`` steps is below the
    threshold, and no later than ``max_steps_factor × steps`` minus the decay. ``end`` is the last step
    plus one."""

    def __init__(self, cfg: SFTConfig, rows: list[Row]) -> None:
        if not any(any(r.get("probe_mask") or ()) for r in rows):
            raise ValueError("hold_until_accuracy needs rows with probe tokens (a probe_mask marking some)")
        self.cfg = cfg
        self.decay = decay_steps(cfg)
        self.start = cfg.steps - self.decay
        self.latest = max(self.start, round(cfg.steps * cfg.max_steps_factor) - self.decay)
        self.window: deque[tuple[float, float]] = deque(maxlen=cfg.probe_window)
        self.decided = False

    @property
    def end(self) -> int:
        return self.start + self.decay

    def accuracy(self) -> float:
        right, marked = (sum(x) for x in zip(*self.window, strict=True)) if self.window else (0.0, 0.0)
        return right / marked if marked else 0.0

    def observe(self, step: int, right: float, marked: float) -> None:
        """Step ``step``'s probe hits, before its learning rate is read."""
        self.window.append((right, marked))
        if self.decided or step < self.start:
            return
        ready = len(self.window) == self.window.maxlen and self.accuracy() >= self.cfg.hold_until_accuracy
        if ready or step >= self.latest:
            self.decided = True
        else:
            self.start = step + 1


def load_model(model_dir: str | Path, cfg: SFTConfig) -> tuple[Any, Any]:
    """(model in float32 on ``cfg.device``, tokenizer) of an HF model directory; seeds torch first."""
    import torch
    import transformers

    torch.manual_seed(cfg.seed)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).to(cfg.device)
    return model, tok


def save_model(model: Any, tokenizer: Any, model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``model`` and its tokenizer as an HF directory, with the base model's exact tokenizer files
    (``save_pretrained`` may re-serialize them: the rollout must tokenize as the base model did)."""
    out, src_dir = Path(out_dir), Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.cpu().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src_dir / name).is_file():
            (out / name).write_bytes((src_dir / name).read_bytes())
    return out


def sft(
    model_dir: str | Path,
    out_dir: str | Path,
    rows: list[Row],
    cfg: SFTConfig,
    log: Callable[[str], Any] = print,
) -> dict[str, float]:
    """Load ``model_dir``, train on ``rows`` (:func:`train_rows`), write the result to ``out_dir``."""
    model, tok = load_model(model_dir, cfg)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    stats = train_rows(model, rows, cfg, pad, log)
    save_model(model, tok, model_dir, out_dir)
    return stats


def warm_start(
    demos: str | Path | Iterable[dict[str, Any]],
    model: str | Path,
    out_dir: str | Path,
    cfg: SFTConfig | None = None,
    log: Callable[[str], Any] = print,
) -> dict[str, float]:
    """The whole warm start: demonstrations (a JSONL file or conversations) rendered with ``model``'s chat
    template, trained on, written to ``out_dir`` with ``sft.json`` (the figures and the config).
    ``model`` is an HF directory or ``pretrained:NAME``."""
    import transformers

    from agentrl.models.pretrained import resolve_model_path

    cfg = cfg or SFTConfig()
    t0 = time.monotonic()
    model_dir = resolve_model_path(str(model))
    conversations = read_demos(demos) if isinstance(demos, str | Path) else list(demos)
    rows = demo_rows(transformers.AutoTokenizer.from_pretrained(model_dir), conversations)
    if not rows:
        raise ValueError("no demonstrations to train on")
    log(f"sft: {len(rows)} demonstrations, {sum(map(len, (r['input_ids'] for r in rows)))} tokens")
    stats = sft(model_dir, out_dir, rows, cfg, log)
    stats["sft/seconds"] = time.monotonic() - t0
    info = {"base_model": str(model), "config": cfg.model_dump(), **stats}
    (Path(out_dir) / "sft.json").write_text(json.dumps(info, indent=2))
    log(f"sft: wrote {out_dir} (final loss {stats['sft/final_loss']:.3f}, {stats['sft/seconds']:.0f} s)")
    return stats


# ---- command line ------------------------------------------------------------------------------------
def _demos_arg(spec: str) -> str | list[dict[str, Any]]:
    """A JSONL path, or ``module:function`` returning conversations (or the path of a file it wrote)."""
    if Path(spec).is_file() or ":" not in spec:
        return spec
    module, _, attr = spec.partition(":")
    sys.path.insert(0, str(Path.cwd()))  # the user's module, from the working directory
    made = getattr(importlib.import_module(module), attr)()
    return str(made) if isinstance(made, str | Path) else list(made)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """The command line (``python -m agentrl.sft``); ``prog`` names it in the usage line."""
    p = argparse.ArgumentParser(
        prog=prog or "python -m agentrl.sft",
        description="Supervised warm start from chat demonstrations (JSONL, OpenAI message format): loss on "
        "the assistant turns, rendered as the rollout renders them. Writes an HF model directory.",
    )
    p.add_argument(
        "--demos",
        required=True,
        help="JSONL file, one {messages, tools} conversation a line; or module:function returning them",
    )
    p.add_argument("--model", required=True, help="base model: an HF directory or pretrained:NAME")
    p.add_argument("--out", required=True, help="output HF model directory (what model_path names)")
    defaults = SFTConfig()
    p.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="demonstrations per step")
    p.add_argument("--lr", type=float, default=defaults.lr, help="AdamW peak learning rate")
    p.add_argument("--schedule", choices=["cosine", "wsd"], default=defaults.schedule)
    p.add_argument("--lm-weight", type=float, default=defaults.lm_weight, help="LM loss on every token")
    p.add_argument("--device", default=defaults.device, help="cpu or cuda")
    p.add_argument("--seed", type=int, default=defaults.seed, help="data order and torch seed")
    a = p.parse_args(argv)
    cfg = SFTConfig(
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        schedule=a.schedule,
        lm_weight=a.lm_weight,
        device=a.device,
        seed=a.seed,
    )
    try:
        warm_start(_demos_arg(a.demos), a.model, a.out, cfg)
    except (ValueError, FileNotFoundError, ChatTemplateError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
