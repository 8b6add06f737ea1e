"""Tool-call parsers against malformed and adversarial model outputs: they never raise."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.tools import HermesParser, parse_search_r1

P = HermesParser(max_calls=4)


def call(name="search", **args) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_several_calls_and_surrounding_text():
    r = P.parse(f"Let me look.\n{call(query='a')}\n{call('python', code='print(1)')}\ndone")
    assert [(c.name, c.arguments) for c in r.calls] == [
        ("search", {"query": "a"}),
        ("python", {"code": "print(1)"}),
    ]
    assert r.errors == [] and r.content == "Let me look.\n\n\ndone"
    assert [c.id for c in r.calls] == ["call_0", "call_1"]


def test_no_call_is_a_plain_answer():
    r = P.parse("The answer is 4.")
    assert not r.has_calls and r.content == "The answer is 4."


@pytest.mark.parametrize(
    "text, expect",
    [
        ("<tool_call>{not json}</tool_call>", "invalid JSON"),
        ("<tool_call></tool_call>", "invalid JSON"),
        ('<tool_call>["search", {"q": 1}]</tool_call>', "expected a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'missing "name"'),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', 'missing "name"'),
        ('<tool_call>{"name": "search", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        (
            '<tool_call>{"name": "search", "arguments": "{broken"}</tool_call>',
            "arguments string is not valid JSON",
        ),
        ('<tool_call>{"name": "search", "arguments": {"query": "x"}', "the </tool_call> tag is missing"),
        ('<tool_call>{"name": "search", "arguments": {"query": "x"}} trailing</tool_call>', "invalid JSON"),
    ],
)
def test_malformed_calls_become_errors(text, expect):
    r = P.parse(text)
    assert r.calls == [] and len(r.errors) == 1 and expect in r.errors[0], r.errors
    assert r.has_calls  # so an env answers with the error instead of ending the episode


def test_tolerated_variants():
    r = P.parse('<tool_call>\n```json\n{"name": "s", "arguments": "{\\"q\\": 1}"}\n```\n</tool_call>')
    assert [(c.name, c.arguments) for c in r.calls] == [("s", {"q": 1})]
    r = P.parse('<tool_call>{"name": "s", "parameters": {"q": 2}}</tool_call>')
    assert r.calls[0].arguments == {"q": 2}
    r = P.parse('<tool_call>{"name": "s", "arguments": null}</tool_call>')
    assert r.calls[0].arguments == {}
    # stop string trimmed by the engine: complete JSON without the closing tag is accepted
    r = P.parse('<tool_call>{"name": "s", "arguments": {"q": 3}}')
    assert r.calls[0].arguments == {"q": 3} and r.errors == []


def test_mixed_good_and_bad_calls():
    r = P.parse(call(query="ok") + "<tool_call>{oops</tool_call>" + call("python", code="1"))
    assert [c.name for c in r.calls] == ["search", "python"] and len(r.errors) == 1
    assert "tool call #2" in r.errors[0]


def test_too_many_calls_are_capped():
    r = P.parse(call(query="x") * 50)
    assert len(r.calls) == 4 and any("too many tool calls" in e for e in r.errors)


def test_adversarial_inputs():
    nested = "<tool_call>" * 1000 + "</tool_call>" * 1000
    r = P.parse(nested)
    assert r.calls == [] and r.errors
    huge = '<tool_call>{"name": "s", "arguments": {"q": "' + "x" * 200_000 + '"}}</tool_call>'
    assert "too long" in P.parse(huge).errors[0]
    deep = '<tool_call>{"name": "s", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    assert HermesParser(max_call_chars=10**7).parse(deep).errors  # RecursionError-free, reported
    r = P.parse('<tool_call>{"name": "s\\u0000", "arguments": {}}</tool_call>')
    assert len(r.calls) + len(r.errors) == 1
    assert P.parse(None).errors  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/{}[]":, tool_callnamearguments\n\\')), max_size=200))
def test_parser_never_raises(text):
    r = P.parse(text)
    assert isinstance(r.content, str)
    assert len(r.calls) <= 4


# ---- Search-R1 tags -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, kind, content",
    [
        ("<think>hmm</think>\n<search> capital of France </search>", "search", "capital of France"),
        ("<answer> Paris </answer>", "answer", "Paris"),
        ("<search>a</search> then <answer>b</answer>", "search", "a"),  # the first block decides
        ("<answer>b</answer><search>a</search>", "answer", "b"),
        ("<search>multi\nline</search>", "search", "multi\nline"),
        ("<search>unclosed", "invalid", ""),
        ("<search>a</answer>", "invalid", ""),
        ("<SEARCH>a</SEARCH>", "invalid", ""),
        ("just text", "invalid", ""),
        ("<answer></answer>", "answer", ""),
        ("<search><answer>x</answer></search>", "search", "<answer>x</answer>"),
    ],
)
def test_search_r1_first_tag_decides(text, kind, content):
    a = parse_search_r1(text)
    assert (a.kind, a.content) == (kind, content)
