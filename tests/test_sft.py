"""The supervised warm start (agentrl.sft): demonstrations tokenized exactly as the rollout builds an
episode, loss on the assistant tokens only, and a training loop that reproduces the Search-R1 demo's SFT."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentrl.buffer import StalenessController
from agentrl.chat import ChatTokenizer
from agentrl.engine.types import GenerateResult, SamplingParams
from agentrl.envs import ToolEnv
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.dataset import Draw
from agentrl.rollout.episode import EpisodeRunner
from agentrl.rollout.metrics import RolloutMetrics
from agentrl.sft import DemoRenderer, SFTConfig, demo_rows, main, read_demos, record_demos, write_demos
from agentrl.tools import tool


@tool
async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


def env() -> ToolEnv:
    return ToolEnv([add], system_prompt="Add with the tool.", max_turns=4, verifier="exact_match")


def policy(task: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """Two calls in one turn, then one more call, then the answer."""
    a, b = task["a"], task["b"]
    call = '<tool_call>\n{{"name": "add", "arguments": {{"a": {}, "b": {}}}}}\n</tool_call>'
    calls = sum(m["role"] == "assistant" for m in messages)
    if calls == 0:
        return call.format(a, b) + call.format(b, a)
    if calls == 1:
        return "Checking. " + call.format(a + b, 0)
    return f"The sum is {a + b}."


TASKS = [
    {"id": f"t{i}", "prompt": f"What is {i} + {i + 3}?", "a": i, "b": i + 3, "label": 2 * i + 3}
    for i in range(3)
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def demos() -> list[dict[str, Any]]:
    return asyncio.run(record_demos(env, TASKS, policy))


def test_recorded_demos_are_openai_conversations(demos: list[dict[str, Any]], tmp_path: Path) -> None:
    assert len(demos) == len(TASKS)
    roles = [m["role"] for m in demos[0]["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant", "tool", "assistant"]
    assert demos[0]["tools"] == env().tools
    assert [m["content"] for m in demos[0]["messages"] if m["role"] == "tool"] == ["3", "3", "3"]
    assert read_demos(write_demos(tmp_path / "d.jsonl", demos)) == demos


def test_only_assistant_tokens_are_trained(tok: Any, demos: list[dict[str, Any]]) -> None:
    chat = ChatTokenizer(tok)
    renderer = DemoRenderer(chat)
    row = renderer.row(demos[0]["messages"], demos[0]["tools"])
    ids, mask = row["input_ids"], row["loss_mask"]
    assert len(ids) == len(mask)
    # the masked-in spans are the assistant turns, each its content then the end-of-turn token
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(ids[start:i])
            start = None
    assistant = [m["content"] for m in demos[0]["messages"] if m["role"] == "assistant"]
    assert [tok.decode(s) for s in spans] == [text + "<|im_end|>" for text in assistant]
    # the prompt (system, tool schemas, user) is masked out and is the rollout's prompt, rendered once
    prompt = chat.prompt_ids(demos[0]["messages"][:2], demos[0]["tools"])
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    assert "<tool_response>" in tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])


def test_ids_equal_the_rollouts_for_the_same_conversation(tok: Any, demos: list[dict[str, Any]]) -> None:
    """Replay each demonstration through the rollout's EpisodeRunner (an engine that answers with the
    demonstration's assistant ids): the trajectory's ids and loss mask are the SFT row's."""
    rows = demo_rows(tok, demos)
    for task, row in zip(TASKS, rows, strict=True):
        engine = Replay(row)
        runner = EpisodeRunner(
            RolloutConfig(group_size=1, batch_size=1, max_turns=4, max_total_tokens=4096),
            engine,  # type: ignore[arg-type]
            ChatTokenizer(tok),
            env,
            StalenessController(max_staleness=1, batch_size=1),
            asyncio.Event(),
        )
        runner.engine_open.set()
        runner.verifier = "exact_match"  # what the orchestrator resolves for the run
        traj = asyncio.run(
            runner.run(Draw("g", task), 0, SamplingParams(max_new_tokens=64), RolloutMetrics(), train=True)
        )
        assert traj.error is None and not engine.turns
        assert traj.prompt_ids + traj.response_ids == row["input_ids"]
        assert [0] * len(traj.prompt_ids) + traj.loss_mask == row["loss_mask"]
        assert sum(len(t.tool_calls) for t in traj.turns) == 3


class Replay:
    """An engine that answers each request with the row's next assistant turn, checking that the ids it
    is sent are the row's up to there."""

    def __init__(self, row: dict[str, list[int]]) -> None:
        self.row = row
        self.turns: list[list[int]] = []
        prev = 0
        for i, m in enumerate(row["loss_mask"]):
            if m and not prev:
                self.turns.append([])
            if m:
                self.turns[-1].append(row["input_ids"][i])
            prev = m

    async def generate(self, input_ids: list[int], sampling: Any, rid: str = "", **kw: Any) -> GenerateResult:
        out = self.turns.pop(0)
        assert input_ids == self.row["input_ids"][: len(input_ids)]  # the history so far is the row's
        return GenerateResult(out, [0.0] * len(out), "stop", weight_version="0")


def test_structured_tool_calls_render_as_the_template_writes_them(tok: Any) -> None:
    renderer = DemoRenderer(ChatTokenizer(tok))
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}],
    }
    assert (
        renderer.assistant_text(message)
        == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    with pytest.raises(ValueError, match="needs at least one assistant"):
        renderer.row([{"role": "user", "content": "hi"}])


def test_command_writes_a_model_dir(
    tiny_model_dir: Path, demos: list[dict[str, Any]], tmp_path: Path
) -> None:
    path = write_demos(tmp_path / "demos.jsonl", demos)
    out = tmp_path / "sft"
    main(
        [
            "--demos",
            str(path),
            "--model",
            str(tiny_model_dir),
            "--out",
            str(out),
            "--steps",
            "3",
            "--batch-size",
            "2",
        ]
    )
    info = json.loads((out / "sft.json").read_text())
    assert info["sft/steps"] == 3 and info["sft/demos"] == len(demos)
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_training_loop_reproduces_the_demo_bootstrap(tiny_model_dir: Path, tok: Any, tmp_path: Path) -> None:
    """The Search-R1 bootstrap's SFT and agentrl.sft on the same rows and settings write the same weights,
    bit for bit: the bootstrap could call the generic loop without changing the demo's numbers."""
    from safetensors.torch import load_file

    from agentrl.examples.search_r1.bootstrap import SFTConfig as BootstrapSFT
    from agentrl.examples.search_r1.bootstrap import sft as bootstrap_sft
    from agentrl.sft import sft

    rows = [
        {
            "input_ids": tok.encode(f"question {i} answer {i * 7}"),
            "loss_mask": [0, 0, 1, 1, 1, 1, 1, 1][: 4 + i % 3],
        }
        for i in range(6)
    ]
    rows = [
        {"input_ids": r["input_ids"], "loss_mask": (r["loss_mask"] + [1] * 99)[: len(r["input_ids"])]}
        for r in rows
    ]
    theirs = BootstrapSFT(steps=4, batch_size=3, lr=1e-3, lm_weight=3.0, micro_batches=2, schedule="wsd")
    ours = SFTConfig(**{k: v for k, v in theirs.model_dump().items() if k in SFTConfig.model_fields})
    bootstrap_sft(tiny_model_dir, tmp_path / "a", rows, theirs, log=lambda _: None)
    sft(tiny_model_dir, tmp_path / "b", rows, ours, log=lambda _: None)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_lr_schedule_with_a_moved_decay_start() -> None:
    from agentrl.sft import lr_at

    cfg = SFTConfig(steps=100, lr=1.0, schedule="wsd", decay_fraction=0.2)
    assert [lr_at(s, cfg) for s in (0, 4, 50, 80, 90, 99)] == pytest.approx([0.2, 1.0, 1.0, 1.0, 0.5, 0.05])
    # the decay moved 30 steps later: the peak held, then the same 20 steps of decay
    assert [lr_at(s, cfg, 110) for s in (80, 109, 110, 120, 129)] == pytest.approx([1, 1, 1, 0.5, 0.05])


def test_held_decay_waits_for_the_probe_accuracy_within_its_limit(tiny_model_dir: Path, tok: Any) -> None:
    """hold_until_accuracy: a probe token the model learns at once starts the decay where the fixed schedule
    does; one it cannot predict (a different token after the same context) holds the peak until
    max_steps_factor × steps leaves room for the decay only."""
    from agentrl.sft import load_model, train_rows

    def rows(learnable: bool) -> list[dict[str, list[int]]]:
        out = []
        for i in range(8):
            ids = [*tok.encode("the answer is"), 100 if learnable else 100 + i]
            probe = [0] * (len(ids) - 1) + [1]
            out.append({"input_ids": ids, "loss_mask": [1] * len(ids), "probe_mask": probe})
        return out

    held = {"hold_until_accuracy": 0.9, "max_steps_factor": 2, "probe_window": 3}
    cfg = SFTConfig(steps=20, batch_size=4, lr=5e-3, schedule="wsd", **held)
    model, _ = load_model(tiny_model_dir, cfg)
    learned = train_rows(model, rows(True), cfg, 0, log=lambda _: None)
    assert learned["sft/steps"] == 20 and learned["sft/decay_start"] == 16
    assert learned["sft/probe_accuracy"] == 1.0
    model, _ = load_model(tiny_model_dir, cfg)
    unlearnable = train_rows(model, rows(False), cfg, 0, log=lambda _: None)
    assert unlearnable["sft/steps"] == 40 and unlearnable["sft/decay_start"] == 36
    assert unlearnable["sft/probe_accuracy"] < 0.9
    with pytest.raises(ValueError, match="probe tokens"):
        train_rows(model, [{k: r[k] for k in ("input_ids", "loss_mask")} for r in rows(True)], cfg, 0)


def test_held_decay_config_errors_name_the_field() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="needs schedule: wsd"):
        SFTConfig(hold_until_accuracy=0.5)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        SFTConfig(steps=20, schedule="wsd", hold_until_accuracy=0.5, max_steps_factor=0.5)


def test_token_scores_are_the_shifted_cross_entropy_and_greedy_hits(tiny_model_dir: Path, tok: Any) -> None:
    """The SFT's per-token scores: each position's negative log-likelihood of the next token, as a
    cross-entropy over the shifted logits gives it, and the probe hits as a full greedy argmax counts them
    (rows of different lengths: padding neither scores nor counts)."""
    import torch

    from agentrl.sft import _token_scores, load_model, right_pad

    model, _ = load_model(tiny_model_dir, SFTConfig())
    texts = ["the answer is blue", "a longer row, the answer is green and more", "x"]
    rows = []
    for text in texts:
        ids = tok.encode(text)
        rows.append({"input_ids": ids, "loss_mask": [1] * len(ids), "probe_mask": [0, *[1] * (len(ids) - 1)]})
    with torch.no_grad():
        nll, mask, attn, (right, marked) = _token_scores(model, rows, 0, "cpu", probe=True)
        ids = right_pad([r["input_ids"] for r in rows], 0)
        pad_mask = right_pad([[1] * len(r["input_ids"]) for r in rows], 0)
        logits = model(input_ids=ids, attention_mask=pad_mask).logits[:, :-1]
        want = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        ).view(len(rows), -1)
    real = attn.bool()
    assert nll.shape == want.shape and torch.equal(nll[real], want[real])
    assert torch.equal(mask, attn) and marked == sum(len(r["input_ids"]) - 1 for r in rows)
    hits = (logits.argmax(-1) == ids[:, 1:])[real].sum().item()
    assert right == hits
