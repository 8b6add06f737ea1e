"""The orchestrator against the stub engine (a labelled SGLang stand-in) over real HTTP on loopback.

Covers token-in/token-out exactness, observation deltas, episode limits, verifiers, failure isolation and
group filtering; weight updates, checkpoint/resume, evaluation and metrics are in test_rollout_updates.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentrl.buffer import DataExhausted, NoProgressError
from agentrl.engine.client import EngineClient
from agentrl.engine.types import GenerateResult, SamplingParams
from agentrl.envs.base import Env, StepResult
from agentrl.rewards import VerifierConfigError
from agentrl.rewards.base import register_verifier
from agentrl.rollout import ChatTokenizer, Orchestrator, RolloutConfig
from agentrl.testing.envs import SyntheticEnv
from agentrl.testing.stub_engine import stub_engine_in_process
from agentrl.types import OBSERVATION_VERSION, Status, ToolCallRecord, Trajectory


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class RecordingClient(EngineClient):
    """The real client, keeping every (input_ids, answer) pair to compare the trajectory against."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.calls: list[tuple[list[int], SamplingParams, GenerateResult]] = []

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        res = await super().generate(input_ids, sampling, rid, return_logprob)
        self.calls.append((list(input_ids), sampling, res))
        return res


def cfg(**kw: Any) -> RolloutConfig:
    base: dict[str, Any] = {
        "group_size": 2,
        "batch_size": 2,
        "max_staleness": 1,
        "max_concurrency": 16,
        "max_turns": 4,
        "max_total_tokens": 1024,
        "filter_zero_variance": False,
        "shuffle": False,
        "record_outcomes": True,
        "sampling": SamplingParams(temperature=1.0, max_new_tokens=16),
    }
    base.update(kw)
    return RolloutConfig(**base)


def tasks(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [
        {"id": f"task{i}", "prompt": f"What is {i} + {i}?", "label": str(2 * i), **extra} for i in range(n)
    ]


async def run_batches(
    orch: Orchestrator, n: int, update_engine: EngineClient | None = None, timeout: float = 30
) -> list[list[Trajectory]]:
    """A trainer: take n batches; after each, a weight update (pause, bump version, resume)."""
    out = []
    for _ in range(n):
        batch = await orch.buffer.get_batch(timeout=timeout)
        for t in batch:
            assert orch.version - t.min_policy_version <= orch.cfg.max_staleness
        out.append(batch)
        await orch.pause_for_update()
        if update_engine is not None:
            await update_engine.update_weight_version(str(orch.version + 1))
        await orch.resume_after_update(orch.version + 1)
    return out


async def drain_all(orch: Orchestrator, engine: EngineClient, timeout: float = 30) -> list[Trajectory]:
    """A trainer that takes batches (updating weights after each) until the dataset is exhausted."""
    got: list[Trajectory] = []
    with pytest.raises(DataExhausted):
        while True:
            got += await orch.buffer.get_batch(timeout=timeout)
            await orch.pause_for_update()
            await engine.update_weight_version(str(orch.version + 1))
            await orch.resume_after_update(orch.version + 1)
    return got


# ---------------------------------------------------------------- token exactness
async def test_token_in_token_out_exact(tok: Any) -> None:
    async with stub_engine_in_process(min_tokens=3, max_tokens=12, seed=1) as (_, url):
        client = RecordingClient(url, timeout=10)
        orch = Orchestrator(
            cfg(group_size=2, batch_size=1), client, tok, lambda: SyntheticEnv(turns=3), tasks(4)
        )
        await orch.start()
        batch = await orch.buffer.get_batch(timeout=30)
        await orch.stop()
        await client.close()
    chat = ChatTokenizer(tok)
    by_prefix: dict[tuple[int, ...], list[GenerateResult]] = {}
    for inp, _, res in client.calls:
        by_prefix.setdefault(tuple(inp), []).append(res)
    for t in batch:
        t.validate()
        # the prompt is the chat template of the initial messages, rendered once
        msgs = [{"role": "user", "content": "What is 0 + 0?"}]
        assert t.prompt_ids == tok.encode(
            tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        conversation = list(msgs)
        for turn in t.turns:
            seg = t.response_ids[turn.start : turn.end]
            if turn.role == "assistant":
                # exactly what the engine sampled for exactly the ids so far: never re-tokenized
                answers = by_prefix[tuple(t.prompt_ids + t.response_ids[: turn.start])]
                assert any(
                    seg == r.output_ids and t.rollout_logprobs[turn.start : turn.end] == r.logprobs
                    for r in answers
                )
                assert set(t.loss_mask[turn.start : turn.end]) == {1}
                assert set(t.policy_versions[turn.start : turn.end]) == {0}
                conversation.append({"role": "assistant", "content": chat.action_text(seg)})
            else:
                assert set(t.loss_mask[turn.start : turn.end]) == {0}
                assert set(t.policy_versions[turn.start : turn.end]) == {OBSERVATION_VERSION}
                assert set(t.rollout_logprobs[turn.start : turn.end]) == {0.0}
                conversation.append({"role": "tool", "content": turn.text})
        # the whole token sequence decodes to the chat template of the conversation: observation deltas
        # are right and the end-of-turn token appears exactly once per assistant turn
        rendered = tok.apply_chat_template(conversation, tokenize=False)
        decoded = tok.decode(t.prompt_ids + t.response_ids, skip_special_tokens=False)
        assert rendered.startswith(decoded) and rendered[len(decoded) :].strip() == ""
        assert t.num_turns == 3 and t.status == Status.COMPLETED


def test_observation_delta_and_end_of_turn(tok: Any) -> None:
    chat = ChatTokenizer(tok)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert eot in chat.eot_ids
    after_eot = chat.observation_ids("hello", last_token_id=eot)
    after_stop = chat.observation_ids("hello", last_token_id=tok.convert_tokens_to_ids("</tool_call>"))
    assert after_stop == [eot, *after_eot]  # the model's end-of-turn token, added exactly once
    text = tok.decode(after_eot, skip_special_tokens=False)
    assert (
        text
        == "\n<|im_start|>user\n<tool_response>\nhello\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    user = tok.decode(chat.observation_ids("hi", eot, role="user"), skip_special_tokens=False)
    assert user == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # the fast path (no jinja per call) renders exactly what the template renders
    for content in ("x", "  spaced\n\ntext ", '{"a": 1}', ""):
        assert chat._delta_text("tool", content) == chat._slow_delta("tool", content)
    # a raw observation (Search-R1 style) is the text alone, no special tokens, no end-of-turn
    assert chat.observation_ids("<information>doc</information>", eot, fmt="raw") == tok.encode(
        "<information>doc</information>", add_special_tokens=False
    )
    with pytest.raises(ValueError, match="observation format"):
        chat.observation_ids("x", eot, fmt="html")


class RawEnv(Env):
    """Search-R1 style: the observation continues the assistant's text (observation_format = raw)."""

    stop = ["</search>"]
    scores_itself = True

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.n = 0
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        self.n += 1
        if self.n >= 2:
            return StepResult(reward=float(self.n), terminated=True)
        return StepResult(observation="<information>doc</information>", observation_format="raw")


async def test_raw_observation_and_stop_strings(tok: Any) -> None:
    async with stub_engine_in_process(min_tokens=2, max_tokens=6) as (_, url):
        client = RecordingClient(url, timeout=10)
        orch = Orchestrator(cfg(group_size=1, batch_size=1), client, tok, RawEnv, tasks(2))
        await orch.start()
        [t] = await orch.buffer.get_batch(timeout=30)
        await orch.stop()
        await client.close()
    obs = [turn for turn in t.turns if turn.role == "observation"]
    assert len(obs) == 1
    assert t.response_ids[obs[0].start : obs[0].end] == tok.encode(
        "<information>doc</information>", add_special_tokens=False
    )
    assert all(sp.stop == ["</search>"] for _, sp, _ in client.calls)  # env stop strings are sent


class OwnFormatEnv(Env):
    """An env with a call format of its own: every action is one ``echo`` call, reported as it ran."""

    scores_itself = True

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.n = 0
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        self.n += 1
        call = ToolCallRecord(
            "echo", {"text": action_text}, f"echo {self.n}", latency_s=0.01 * self.n, id=f"c{self.n}"
        )
        if self.n >= 3:
            return StepResult(reward=1.0, terminated=True, tool_calls=[call])
        return StepResult(observation=f"echo {self.n}", tool_calls=[call])


async def test_env_tool_call_records_land_on_their_model_turn(tok: Any) -> None:
    async with stub_engine_in_process(min_tokens=2, max_tokens=6) as (_, url):
        client = EngineClient(url, timeout=10)
        got = {}
        for name, factory in (("own", OwnFormatEnv), ("none", RawEnv)):
            orch = Orchestrator(cfg(group_size=1, batch_size=1), client, tok, factory, tasks(1))
            await orch.start()
            [got[name]] = await orch.buffer.get_batch(timeout=30)
            await orch.stop()
        await client.close()
    t = got["own"]
    assistant = [turn for turn in t.turns if turn.role == "assistant"]
    assert len(assistant) == 3 and t.status == Status.COMPLETED
    for i, turn in enumerate(assistant, 1):  # the env's record of the step that answered this turn
        assert turn.tool_calls == [
            ToolCallRecord("echo", {"text": turn.text}, f"echo {i}", latency_s=0.01 * i, id=f"c{i}")
        ]
    assert all(turn.tool_calls == [] for turn in t.turns if turn.role == "observation")
    assert Trajectory.from_dict(t.to_dict()) == t
    # an env that records no calls still runs; its turns simply carry none
    assert got["none"].status == Status.COMPLETED and all(turn.tool_calls == [] for turn in got["none"].turns)


class MessagesOnlyEnv(Env):
    """Two tool results a step, given only as ``StepResult.messages`` (no joined ``observation``)."""

    scores_itself = True

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.n = 0
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        self.n += 1
        if self.n >= 3:
            return StepResult(reward=1.0, terminated=True)
        msgs = [
            {"role": "tool", "content": f"first result {self.n}", "name": "a", "tool_call_id": f"a{self.n}"},
            {"role": "tool", "content": f"second result {self.n}", "name": "b"},
        ]
        return StepResult(messages=msgs)


async def test_observation_messages_reach_the_model(tok: Any) -> None:
    async with stub_engine_in_process(min_tokens=2, max_tokens=6, seed=3) as (_, url):
        client = RecordingClient(url, timeout=10)
        orch = Orchestrator(cfg(group_size=1, batch_size=1), client, tok, MessagesOnlyEnv, tasks(1))
        await orch.start()
        [t] = await orch.buffer.get_batch(timeout=30)
        stats = orch.stats()
        await orch.stop()
        await client.close()
    chat = ChatTokenizer(tok)
    obs = [turn for turn in t.turns if turn.role == "observation"]
    assert t.status == Status.COMPLETED and len(obs) == 2
    for i, turn in enumerate(obs, 1):
        text = tok.decode(t.response_ids[turn.start : turn.end], skip_special_tokens=False)
        assert f"first result {i}" in text and f"second result {i}" in text
        assert turn.text == f"first result {i}\nsecond result {i}"
        assert all(m == 0 for m in t.loss_mask[turn.start : turn.end])
    # the model's next request held exactly those tokens: what the template renders for the two messages
    last = t.response_ids[obs[0].start - 1]
    msgs = [{"role": "tool", "content": "first result 1"}, {"role": "tool", "content": "second result 1"}]
    assert t.response_ids[obs[0].start : obs[0].end] == chat.observation_messages_ids(msgs, last)
    assert t.prompt_ids + t.response_ids[: obs[0].end] in [ids for ids, _, _ in client.calls]
    assert stats["rollout/observation_tokens"] >= sum(turn.end - turn.start for turn in obs)  # more may run


def test_observation_messages_render_as_in_a_conversation(tok: Any) -> None:
    chat = ChatTokenizer(tok)
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "calls"}]
    msgs = [{"role": "tool", "content": "one"}, {"role": "tool", "content": "two"}]
    whole = tok.apply_chat_template([*base, *msgs], tokenize=False, add_generation_prompt=True)
    head = tok.apply_chat_template(base, tokenize=False)
    eot = chat._eot_in_tail
    assert whole.startswith(head[: head.rfind("calls") + len("calls")])
    delta = whole[head.rfind("calls") + len("calls") :]
    assert chat.observation_messages_ids(msgs, None) == chat.encode(delta)
    assert chat.observation_messages_ids(msgs, eot) == chat.encode(delta)[1:]
    # one message takes the cached path and gives the same ids as the single observation
    assert chat.observation_messages_ids(msgs[:1], eot) == chat.observation_ids("one", eot)
    with pytest.raises(ValueError, match="content"):
        chat.observation_messages_ids([{"role": "tool"}], eot)


class SilentEnv(Env):
    """Goes on without showing the model anything: counted, not silently accepted."""

    scores_itself = True

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.n = 0
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        self.n += 1
        return StepResult(reward=1.0, terminated=True) if self.n >= 3 else StepResult()


async def one_batch(
    config: RolloutConfig, tok: Any, env: Any, n_tasks: int, timeout: float = 30, **engine: Any
) -> tuple[list[Trajectory], dict[str, Any]]:
    """One batch of ``env``'s episodes against the stand-in engine (``engine``: its settings), and the
    rollout's metrics once it is in."""
    async with stub_engine_in_process(**engine) as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(config, client, tok, env, tasks(n_tasks))
        await orch.start()
        batch = await orch.buffer.get_batch(timeout=timeout)
        stats = orch.stats()
        await orch.stop()
        await client.close()
    return batch, stats


async def test_steps_without_observation_are_counted(tok: Any, caplog: pytest.LogCaptureFixture) -> None:
    _, stats = await one_batch(cfg(group_size=2, batch_size=1), tok, SilentEnv, 1, min_tokens=2, max_tokens=6)
    # two silent steps an episode, for the batch's two episodes and any others admission let start
    n = stats["rollout/steps_without_observation"]
    assert n >= 4 and n % 2 == 0
    warned = [r for r in caplog.records if "neither observation nor messages" in r.getMessage()]
    assert len(warned) == 1 and "SilentEnv" in warned[0].getMessage()


async def test_requests_without_the_routing_replay_asked_for_are_counted(
    tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # routing replay on, an engine that answers without routed_experts (a dense model, or an SGLang server
    # started without --enable-return-routed-experts): every such turn counted, one warning naming the flag
    config = cfg(group_size=2, batch_size=1, return_routed_experts=True)
    batch, stats = await one_batch(config, tok, lambda: SyntheticEnv(turns=2), 1, max_tokens=6)
    turns = sum(t.num_turns for t in batch)
    assert stats["rollout/requests_without_routing"] >= turns >= 2
    assert all(t.routed_experts is None for t in batch)
    warned = [r for r in caplog.records if "no routed_experts" in r.getMessage()]
    assert len(warned) == 1 and "--enable-return-routed-experts" in warned[0].getMessage()
    _, plain = await one_batch(cfg(group_size=2, batch_size=1), tok, lambda: SyntheticEnv(turns=2), 1)
    assert "rollout/requests_without_routing" not in plain


MEMORY_BOMB = "x = []\nwhile True:\n    x.append(bytearray(16 * 2**20))"


async def test_tool_errors_and_episodes_without_a_parsed_call_are_counted(
    tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A ToolEnv over the python tool in a real process sandbox, the model's turns scripted: a call whose
    run the sandbox kills for memory, a malformed call, no call. The killed run and the malformed call are
    error results the model is shown and the metrics count; the two episodes without a call the env parsed
    are counted and warned about once."""
    import json

    from agentrl.sandboxes import ProcessSandbox
    from agentrl.tools.python import python_tool
    from envs.tool_env import ToolEnv

    call = {"name": "python", "arguments": {"code": MEMORY_BOMB}}
    turns = [
        f"<tool_call>\n{json.dumps(call)}\n</tool_call>",  # episode 1: a call the sandbox kills ...
        "done",  # ... then an answer
        '<tool_call>\n{"name": "python", "arguments": \n</tool_call>',  # episode 2: malformed ...
        "done",  # ... then an answer
        "no tools needed",  # episode 3: no call at all
    ]
    # the stand-in answers its n-th request (from 1) with script[n % len]: the last turn goes first
    script = [tok.encode(t, add_special_tokens=False) for t in [turns[-1], *turns[:-1]]]
    config = cfg(
        group_size=1,
        batch_size=3,
        max_concurrency=1,  # one episode at a time: the script's turns go to them in order
        verifier="rollout_len",
        sampling=SamplingParams(temperature=1.0, max_new_tokens=256),
    )
    async with ProcessSandbox(memory_mb=256) as box:
        env = lambda: ToolEnv(tools=[python_tool(box, timeout=20)])  # noqa: E731
        batch, stats = await one_batch(config, tok, env, 3, timeout=60, script=script)
    records = [c for t in batch for turn in t.turns for c in turn.tool_calls]
    killed = [c for c in records if c.name == "python"]
    assert killed and "SandboxRunKilled" in (killed[0].error or "") and "memory" in killed[0].error
    assert any(c.name is None and c.error for c in records)  # the malformed call, with why
    # the model saw the error text of both (observation tokens after the call)
    seen = [tok.decode(t.response_ids) for t in batch]
    assert any("SandboxRunKilled" in text for text in seen)
    assert stats["rollout/tool_calls"] >= 2 and stats["rollout/tool_call_errors"] >= 2
    assert stats["rollout/episodes_without_tool_calls"] >= 2
    warned = [r for r in caplog.records if "without one tool call the env parsed" in r.getMessage()]
    assert len(warned) == 1 and "ToolEnv" in warned[0].getMessage()


class SlowStepEnv(Env):
    """A step that spends 0.2 s of its own around one 5 ms tool call it reports with that latency."""

    scores_itself = True

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action_text: str) -> StepResult:
        await asyncio.sleep(0.2)  # the env's own work: parsing, bookkeeping, a slow verifier call
        call = ToolCallRecord("lookup", {"q": "x"}, result="y", latency_s=0.005)
        return StepResult(reward=1.0, terminated=True, tool_calls=[call])


async def test_tool_latency_is_the_calls_own_time(tok: Any) -> None:
    """rollout/tool_latency_* time the calls an env reports, not its whole step."""
    _, stats = await one_batch(
        cfg(group_size=2, batch_size=1), tok, SlowStepEnv, 1, min_tokens=2, max_tokens=4
    )
    assert stats["rollout/tool_latency_mean_s"] == pytest.approx(0.005)
    assert stats["rollout/tool_calls"] >= 2 and stats.get("rollout/tool_call_errors", 0) == 0


# ---------------------------------------------------------------- limits
async def test_limits_truncate(tok: Any) -> None:
    async with stub_engine_in_process(min_tokens=8, max_tokens=8) as (_, url):
        client = EngineClient(url, timeout=10)
        # max_turns
        orch = Orchestrator(
            cfg(group_size=1, batch_size=1, max_turns=2, verifier="rollout_len"),
            client,
            tok,
            lambda: SyntheticEnv(turns=10),
            tasks(1, turns=10),
        )
        await orch.start()
        [t] = await orch.buffer.get_batch(timeout=30)
        await orch.stop()
        assert t.status == Status.TRUNCATED and t.num_turns == 2
        # max_total_tokens: never exceeded, the last request asks only for what fits
        orch = Orchestrator(
            cfg(group_size=1, batch_size=1, max_turns=50, max_total_tokens=60, verifier="rollout_len"),
            client,
            tok,
            lambda: SyntheticEnv(turns=50),
            tasks(1),
        )
        await orch.start()
        [t] = await orch.buffer.get_batch(timeout=30)
        await orch.stop()
        assert t.status == Status.TRUNCATED
        assert len(t.prompt_ids) + len(t.response_ids) <= 60
        assert t.reward == len(t.response_ids)
        # the context length is a limit too
        orch = Orchestrator(
            cfg(group_size=1, batch_size=1, max_turns=50, max_context_length=40, verifier="rollout_len"),
            client,
            tok,
            lambda: SyntheticEnv(turns=50),
            tasks(1),
        )
        await orch.start()
        [t] = await orch.buffer.get_batch(timeout=30)
        await orch.stop()
        await client.close()
        assert t.status == Status.TRUNCATED and len(t.prompt_ids) + len(t.response_ids) <= 40


@register_verifier("rollout_len", overwrite=True)
async def _len_verifier(trajectory: Trajectory, label: Any) -> float:
    return float(len(trajectory.response_ids))


@register_verifier("rollout_broken", overwrite=True)
async def _broken_verifier(trajectory: Trajectory, label: Any) -> float:
    raise RuntimeError("verifier bug")


class NoRewardEnv(SyntheticEnv):
    scores_itself = False  # its episodes end without a reward: a verifier must score them

    async def step(self, action_text: str) -> StepResult:
        r = await super().step(action_text)
        r.reward = None
        return r


class BrokenPromiseEnv(NoRewardEnv):
    scores_itself = True  # ... but its episodes end without a reward


async def test_verifier_scores_and_failures_are_loud(tok: Any) -> None:
    async with stub_engine_in_process() as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(
            cfg(group_size=1, batch_size=1, verifier="rollout_len"),
            client,
            tok,
            lambda: NoRewardEnv(turns=1),
            tasks(2),
        )
        await orch.start()
        [t] = await orch.buffer.get_batch(timeout=30)
        await orch.stop()
        assert t.reward == float(len(t.response_ids)) and t.status == Status.COMPLETED
        # a raising verifier fails the episode (never a silent 0.0); retried, then the group is dropped;
        # a whole pass of such drops stops the run, naming the verifier
        orch = Orchestrator(
            cfg(group_size=1, batch_size=1, verifier="rollout_broken", max_retries=1, epochs=1),
            client,
            tok,
            lambda: NoRewardEnv(turns=1),
            tasks(3),
        )
        await orch.start()
        with pytest.raises(NoProgressError, match=r"\(failed:verifier 3\).*verifier bug.*rollout\.verifier"):
            await orch.buffer.get_batch(timeout=30)
        await orch.stop()
        assert orch.m.failures["verifier"] == 6 and orch.m.counters["retries"] == 3
        assert orch.m.dropped["failed:verifier"] == 3
        # no verifier anywhere: the run fails at start-up, before any episode
        orch = Orchestrator(
            cfg(group_size=1, batch_size=1), client, tok, lambda: NoRewardEnv(turns=1), tasks(1)
        )
        with pytest.raises(VerifierConfigError, match=r"rollout\.verifier: not set"):
            await orch.start()
        assert orch.drawn == 0
        # an env that claims to score itself but ends without a reward: FAILED with an explicit error
        orch = Orchestrator(
            cfg(group_size=1, batch_size=1, max_retries=0, epochs=1, failed_member_policy="drop_member"),
            client,
            tok,
            lambda: BrokenPromiseEnv(turns=1),
            tasks(1),
        )
        await orch.start()
        with pytest.raises(DataExhausted):
            await orch.buffer.get_batch(timeout=30)
        await orch.stop()
        await client.close()
        assert orch.m.failures["reward"] == 1 and orch.m.dropped["failed:reward"] == 1


# ---------------------------------------------------------------- groups, filtering, failures
class ConstRewardEnv(SyntheticEnv):
    """Reward 1.0 for tasks marked 'easy' (zero variance), random otherwise."""

    async def step(self, action_text: str) -> StepResult:
        r = await super().step(action_text)
        if r.terminated and self.task_easy:
            r.reward = 1.0
        return r

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.task_easy = bool(task.get("easy"))
        return await super().reset(task)


async def test_zero_variance_groups_dropped_without_deadlock(tok: Any) -> None:
    # the first 30 tasks all give zero-variance groups; with eta=0 and B=2 a dropped group that kept its
    # capacity would stall admission forever (AReaL PR #1396)
    ts = [{"prompt": f"p{i}", "easy": i < 30} for i in range(60)]
    async with stub_engine_in_process() as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(
            cfg(group_size=4, batch_size=2, max_staleness=0, filter_zero_variance=True),
            client,
            tok,
            lambda: ConstRewardEnv(turns=1, reward_p=0.5),
            ts,
        )
        await orch.start()
        [batch] = await run_batches(orch, 1, client)
        await orch.stop()
        await client.close()
    assert len(batch) == 8 and len({t.group_id for t in batch}) == 2
    assert orch.m.dropped["zero_variance"] >= 30
    for gid in {t.group_id for t in batch}:
        assert len({t.reward for t in batch if t.group_id == gid}) > 1
    acc = orch.accounting()
    assert acc["balanced"] == 1


class FlakyEnv(SyntheticEnv):
    """Raises on every step of sample 0 of odd tasks (a persistent tool failure)."""

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.bad = bool(task.get("bad"))
        return await super().reset(task)

    async def step(self, action_text: str) -> StepResult:
        if self.bad:
            raise RuntimeError("tool exploded")
        return await super().step(action_text)


@pytest.mark.parametrize("policy", ["drop_group", "drop_member"])
async def test_failure_isolation_and_group_policy(tok: Any, policy: str) -> None:
    made = []

    def factory() -> Env:
        env = FlakyEnv(turns=2)
        made.append(env)
        return env

    ts = [{"prompt": f"p{i}", "bad": i % 2 == 1} for i in range(6)]
    async with stub_engine_in_process() as (_, url):
        client = EngineClient(url, timeout=10)
        orch = Orchestrator(
            cfg(
                group_size=2,
                batch_size=1,
                max_retries=2,
                epochs=1,
                failed_member_policy=policy,
                min_group_size=2 if policy == "drop_group" else 1,
            ),
            client,
            tok,
            factory,
            ts,
        )
        await orch.start()
        got = await drain_all(orch, client)
        await orch.stop()
        await client.close()
    assert all(e.closed for e in made)  # env.close() ran for every episode, failed ones included
    bad_tasks = 3
    assert orch.m.failures["env"] == bad_tasks * 2 * 3  # 2 samples, 1 try + 2 retries each
    assert orch.m.dropped["failed:env"] == bad_tasks, (
        orch.outcomes,
        dict(orch.m.failures),
        dict(orch.m.counters),
    )
    assert {t.status for t in got} <= {Status.COMPLETED}
    assert orch.accounting() == {**orch.accounting(), "drawn": 6, "trained": 3, "dropped": 3, "in_flight": 0}
    # the failed episodes (their last attempts) are kept for the episode dumps, once
    failed = orch.take_failed()
    assert len(failed) == bad_tasks * 2 and all(t.status == Status.FAILED and t.error for t in failed)
    assert orch.take_failed() == []
