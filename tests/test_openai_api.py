"""The embedded engine's OpenAI-compatible endpoints, driven by the real ``openai`` SDK over loopback HTTP:
token-exact against ``/generate``, a tool-calling loop (a tiny model taught two conversations), a
malformed call as plain content, streaming (deltas while the engine generates, equal to the non-streamed
answer, never a split character), text completions, OpenAI-style 400s, and a client that disconnects
aborting its request in the engine, streamed or not."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.chat import ChatTokenizer
from agentrl.embedded.launch import start_embedded_server
from agentrl.engine.client import EngineClient
from agentrl.engine.openai_api import parse_tool_calls
from agentrl.engine.openai_stream import StableText
from agentrl.engine.types import SamplingParams

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
TAUGHT = [
    [
        {"role": "user", "content": "What is 2 plus 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "The answer is 5."},
    ],
    [
        {"role": "user", "content": "Break the tool."},
        {"role": "assistant", "content": '<tool_call>\n{"name": oops\n</tool_call>'},
    ],
]


def teach(src: Path, out: Path, steps: int = 160) -> Path:
    """Fine-tune the tiny model until greedy decoding replays TAUGHT (a real checkpoint directory)."""
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    seqs = [tok.apply_chat_template(c, tools=TOOLS, tokenize=False) for c in TAUGHT]
    ids = [torch.tensor([tok(s, add_special_tokens=False).input_ids]) for s in seqs]
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = sum(model(x, labels=x).loss for x in ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def taught_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return teach(tiny_model_dir, tmp_path_factory.mktemp("taught"))


@pytest.fixture(scope="module")
def server(taught_dir: Path):
    srv = start_embedded_server(taught_dir, max_batch_size=16)
    yield srv
    srv.stop()


@pytest.fixture
async def client(server):
    c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


async def model_name(client: openai.AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


async def engine_info(server) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{server.url}/get_server_info") as resp:
        return await resp.json()


async def assert_aborted(server, decode_steps_before: int, max_tokens: int) -> None:
    """The engine lets go of the request whose client left, and did not run it to ``max_tokens``."""
    deadline = time.monotonic() + 10
    while (info := await engine_info(server))["num_running_requests"] > 0:
        assert time.monotonic() < deadline, "the engine kept a request whose client left"
        await asyncio.sleep(0.02)
    assert info["decode_steps"] - decode_steps_before < max_tokens - 1, "it generated on for nobody"


async def test_chat_is_token_exact_with_generate(server, client, taught_dir):
    model = await model_name(client)
    msgs = [{"role": "user", "content": "Tell me something."}]
    r = await client.chat.completions.create(
        model=model, messages=msgs, max_tokens=12, temperature=1.0, seed=7, logprobs=True, top_logprobs=3
    )
    ch = r.choices[0]
    assert r.usage.completion_tokens == len(ch.logprobs.content) > 0
    # the same rendered prompt and seed through the native /generate: the same tokens and logprobs
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(taught_dir))
    ids = chat.prompt_ids(msgs)
    assert r.usage.prompt_tokens == len(ids)
    native = EngineClient(server.url)
    try:
        g = await native.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=12, sampling_seed=7))
    finally:
        await native.close()
    # (same ids; logprobs within float noise: the second request reuses the first one's cached prefix)
    assert [c.logprob for c in ch.logprobs.content] == pytest.approx(g.logprobs, abs=1e-5)
    assert "".join(c.token for c in ch.logprobs.content) == chat.tok.decode(g.output_ids)
    for c in ch.logprobs.content:  # top_logprobs: descending, the sampled token's own logprob is <= the best
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and c.logprob <= tops[0] + 1e-4


async def test_tool_calling_loop(client):
    model = await model_name(client)
    messages: list = [{"role": "user", "content": "What is 2 plus 3?"}]
    r = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", msg
    call = msg.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert call.id.startswith("call_")
    messages.append(msg)  # the SDK's own message object, as agents do
    args = json.loads(call.function.arguments)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    r2 = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0)
    assert r2.choices[0].message.content == "The answer is 5."
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls


async def test_malformed_tool_call_is_plain_content(client):
    model = await model_name(client)
    r = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Break the tool."}], tools=TOOLS, temperature=0
    )
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and not ch.message.tool_calls
    assert ch.message.content.startswith("<tool_call>") and "oops" in ch.message.content
    # the parser's own rules: a good call, a bad one, Llama 3's bare JSON
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "hermes")[1]
    assert parse_tool_calls("<tool_call>{bad</tool_call>", "hermes") == ("<tool_call>{bad</tool_call>", [])
    content, calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"x": 1}}', "llama3")
    assert content is None and calls[0]["function"]["name"] == "f"


async def test_streaming_matches_non_streaming(client):
    model = await model_name(client)
    kw = dict(model=model, messages=[{"role": "user", "content": "What is 2 plus 3?"}], temperature=0)
    whole = await client.chat.completions.create(**kw, tools=TOOLS)
    stream = await client.chat.completions.create(
        **kw, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    calls, finish, usage = {}, None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                calls.setdefault(d.index, []).append(d.function.arguments or "")
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and usage.total_tokens == whole.usage.total_tokens
    assert json.loads("".join(calls[0])) == json.loads(
        whole.choices[0].message.tool_calls[0].function.arguments
    )
    # sampled, two choices: the concatenated deltas are the non-streamed content, choice by choice
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=60,
        seed=3,
        n=2,
        extra_body={"ignore_eos": True},  # 60 tokens each, whatever is sampled
    )
    texts, deltas = ["", ""], 0
    async for chunk in await client.chat.completions.create(**kw, temperature=1.0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            deltas += bool(c.delta.content)
    again = await client.chat.completions.create(**kw, temperature=1.0)
    assert texts == [c.message.content for c in again.choices] and all(texts)
    assert deltas > 4  # sent piece by piece, not as one block per choice
    kw = dict(model=model, prompt="The answer is", max_tokens=40, seed=5, temperature=1.0)
    text = ""
    async for chunk in await client.completions.create(**kw, stream=True):
        text += "".join(c.text for c in chunk.choices)
    assert text == (await client.completions.create(**kw)).choices[0].text


def test_stable_text_never_splits_a_character_and_holds_what_may_change(tiny_model_dir):
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))
    text = "héllo wörld, 你好 ünïcode! The end."
    ids = chat.tok.encode(text, add_special_tokens=False)
    assert chat.tok.decode(ids) == text
    for sampling, fmt in (({}, None), ({"stop": ["end"]}, None), ({}, "hermes")):
        st = StableText(chat, sampling, fmt)
        pieces = [st.push([t]) for t in ids]
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) == st.sent and text.startswith(st.sent)
        assert st.sent + st.rest(text) == text
    assert st.sent == "héllo wörld, 你好 ünïcode! The end."  # no tool call could begin
    stop = StableText(chat, {"stop": ["The end"]}, None)
    assert (
        "".join(stop.push([t]) for t in ids) == "héllo wörld, 你好 ünïcode!"
    )  # the stop string's start held
    call = StableText(chat, {}, "hermes")
    for t in chat.tok.encode('Sure. <tool_call>\n{"name": "add"}', add_special_tokens=False):
        call.push([t])
    assert call.sent == "Sure."  # from where a call begins, and the space before it, held to the end
    assert StableText(chat, {}, "hermes").push(chat.tok.encode(" Hi there", add_special_tokens=False)) == ""


async def test_stream_sends_tokens_while_generating_and_disconnect_aborts(server, client):
    """The first delta arrives while the engine still runs the request (a 1,500-token completion);
    closing the stream then aborts it in the engine."""
    model = await model_name(client)
    before = (await engine_info(server))["decode_steps"]
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1500,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    async for chunk in stream:
        if any(c.delta.content for c in chunk.choices):
            break
    assert chunk.choices[0].finish_reason is None
    info = await engine_info(server)
    assert info["num_running_requests"] == 1, "the first delta came only after the completion had finished"
    await stream.close()  # the SDK closes the connection
    await assert_aborted(server, before, 1500)


async def test_completions_and_n(client):
    model = await model_name(client)
    r = await client.completions.create(
        model=model, prompt="The answer is", max_tokens=6, logprobs=2, n=3, seed=1
    )
    assert len(r.choices) == 3 and {c.index for c in r.choices} == {0, 1, 2}
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) for c in r.choices)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    chat = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5, seed=11
    )
    assert [c.index for c in chat.choices] == [0, 1]


async def test_bad_input_is_an_openai_400(server, client):
    model = await model_name(client)
    ok = [{"role": "user", "content": "hi"}]

    async def bad(**kw):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(**{"model": model, "messages": ok, "max_tokens": 4, **kw})
        err = info.value.body
        assert set(err) >= {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        return err

    assert (await bad(model="no-such-model"))["code"] == "model_not_found"
    assert (await bad(messages="hi"))["param"] == "messages"
    bad_tool = [{"type": "function", "function": {"name": "has space", "parameters": {}}}]
    assert (await bad(tools=bad_tool))["param"] == "tools[0].function.name"
    schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
    assert (await bad(tools=schema))["param"] == "tools[0].function.parameters"
    long = [{"role": "user", "content": "word " * 5000}]
    assert (await bad(messages=long, max_tokens=None))["code"] == "context_length_exceeded"
    assert (await bad(max_tokens=10**6))["code"] == "context_length_exceeded"
    assert (await bad(frequency_penalty=0.5))["param"] == "frequency_penalty"
    assert (await bad(tool_choice={"type": "function", "function": {"name": "nope"}}, tools=TOOLS))[
        "param"
    ] == "tool_choice"
    async with aiohttp.ClientSession() as s:  # not even JSON: still OpenAI's shape, never a 500
        async with s.post(f"{server.url}/v1/chat/completions", data=b"{nope") as resp:
            assert resp.status == 400 and "error" in await resp.json()


async def test_client_disconnect_aborts_in_engine(server, client):
    model = await model_name(client)
    before = (await engine_info(server))["decode_steps"]
    long = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1500,
        extra_body={"ignore_eos": True},
        timeout=60,
    )
    task = asyncio.ensure_future(long)
    deadline = time.monotonic() + 30
    while (await engine_info(server))["num_running_requests"] == 0:
        assert time.monotonic() < deadline, "the request never reached the engine"
        await asyncio.sleep(0.02)
    task.cancel()  # the SDK closes the connection
    await asyncio.gather(task, return_exceptions=True)
    await assert_aborted(server, before, 1500)
