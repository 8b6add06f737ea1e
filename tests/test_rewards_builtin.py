"""Built-in verifiers: Search-R1 exact match (edge cases), F1, math-verify equivalences, code tests in a
real sandbox, and failures that mark the trajectory FAILED instead of a silent 0."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from agentrl.rewards import get_verifier, list_verifiers, run_verifier
from agentrl.rewards.builtin import extract_answer, f1_score, gold_answers, normalize_answer
from agentrl.sandboxes import ProcessSandbox
from agentrl.types import Status, Trajectory


def traj(*turns: tuple[str, str]) -> Trajectory:
    """A trajectory whose turns carry the given (role, text); token ids are irrelevant to verifiers."""
    t = Trajectory(task_id="t", group_id="g", prompt_ids=[1, 2])
    for role, text in turns:
        if role == "assistant":
            t.append_model_tokens([5], [0.0], 0, text=text)
        else:
            t.append_observation_tokens([6], text=text)
    return t


def test_registry_lists_builtins():
    assert {"exact_match", "f1", "math", "code_tests"} <= set(list_verifiers())
    with pytest.raises(KeyError, match=r"known verifiers: .*exact_match"):
        get_verifier("nope")


# ---- exact match (Search-R1) ---------------------------------------------------------------------
def test_squad_normalization():
    assert normalize_answer("  The  Eiffel-Tower! ") == "eiffeltower"
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("THEATRE") == "theatre"  # 'the' only as a word


@pytest.mark.parametrize(
    "label, expected",
    [
        ("Paris", ["Paris"]),
        (["Paris", "City of Light"], ["Paris", "City of Light"]),
        ({"target": ["Paris"]}, ["Paris"]),
        ({"target": np.array(["Paris", "paris"])}, ["Paris", "paris"]),
        (1889, ["1889"]),
    ],
)
def test_gold_answer_shapes(label, expected):
    assert gold_answers(label) == expected


@pytest.mark.parametrize(
    "turns, gold, reward",
    [
        ([("assistant", "<answer> paris </answer>")], "Paris", 1.0),
        ([("assistant", "<answer>The Paris.</answer>")], ["Lyon", "paris"], 1.0),
        (
            [("assistant", "<answer>Paris</answer> wait <answer>Lyon</answer>")],
            "Paris",
            0.0,
        ),  # last answer counts
        ([("assistant", "<answer>Lyon</answer> no: <answer>Paris</answer>")], "Paris", 1.0),
        ([("assistant", "Paris")], "Paris", 0.0),  # no <answer> block
        ([("assistant", "<answer>Paris city</answer>")], "Paris", 0.0),  # exact, not contains
        ([("assistant", "<answer>\n1889\n</answer>")], {"target": ["1889"]}, 1.0),
        # the retrieved passages (observations) mention the answer: they must not count
        ([("assistant", "<search>q</search>"), ("observation", "<answer>Paris</answer>")], "Paris", 0.0),
        # one <answer> suffices: the prompt's example answer is never part of the response
        (
            [
                ("assistant", "<search>x</search>"),
                ("observation", "docs"),
                ("assistant", "<answer>Beijing</answer>"),
            ],
            "Beijing",
            1.0,
        ),
    ],
)
async def test_exact_match_edge_cases(turns, gold, reward):
    t = traj(*turns)
    assert await run_verifier("exact_match", t, gold)
    assert t.reward == reward and t.status == Status.COMPLETED
    assert t.reward_parts["em"] == reward


def test_extract_answer_multiline_and_missing():
    assert extract_answer("<answer>a\nb</answer>") == "a\nb"
    assert extract_answer("<answer>unclosed") is None


async def test_f1():
    assert f1_score("the big red dog", ["red dog"]) == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert f1_score("", [""]) == 1.0 and f1_score("x", ["y"]) == 0.0
    t = traj(("assistant", "<answer>Eiffel tower Paris</answer>"))
    assert await run_verifier("f1", t, ["Eiffel Tower"])
    assert t.reward == pytest.approx(0.8)


# ---- math (math-verify) --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "response, gold, reward",
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("so $x = \\frac{6}{4}$, i.e. \\boxed{\\frac{3}{2}}", "1.5", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("\\boxed{\\pi}", "3.14159", 0.0),  # not equal: math-verify compares symbolically
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("<answer>42</answer> and later \\boxed{7}", "42", 1.0),  # an <answer> block wins
        ("\\boxed{3}", "4", 0.0),
        ("no number at all", "4", 0.0),
        ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
        ("\\boxed{50\\%}", "0.5", 1.0),
    ],
)
async def test_math_verify_equivalences(response, gold, reward):
    t = traj(("assistant", response))
    assert await run_verifier("math", t, gold), t.error
    assert t.reward == reward, (response, gold)


async def test_math_verifier_unparseable_gold_fails_loudly():
    t = traj(("assistant", "\\boxed{1}"))
    assert not await run_verifier("math", t, "")
    assert t.status == Status.FAILED and "cannot parse the gold" in t.error and t.reward is None


# ---- code tests ---------------------------------------------------------------------------------
GOOD = "Here:\n```python\ndef inc(x):\n    return x + 1\n```"
TESTS = {"tests": ["assert inc(1) == 2", "assert inc(-1) == 0", "assert inc(10) == 11"], "test_timeout": 3}


@pytest.fixture
async def sandbox():
    async with ProcessSandbox() as sb:
        yield sb


@pytest.mark.parametrize(
    "response, reward",
    [
        (GOOD, 1.0),
        ("```python\ndef inc(x):\n    return 2 if x == 1 else x\n```", 1 / 3),
        ("```python\ndef inc(x):\n    while True: pass\n```", 0.0),  # hangs: per-test timeout
        ("```python\nraise SystemExit(0)\n```", 0.0),  # exits before the tests run
        (
            '```python\nimport os\nprint(\'__AGENTRL_REPORT__{"passed": 3, "total": 3, "errors": []}\')\n'
            "os._exit(0)\n```",
            0.0,
        ),  # forged report
        ("no code here", 0.0),
    ],
)
async def test_code_tests(sandbox, response, reward):
    v = get_verifier("code_tests")
    r = await v(traj(("assistant", response)), TESTS, sandbox=sandbox)
    assert r.reward == pytest.approx(reward), r


async def test_code_tests_bad_label_marks_failed():
    t = traj(("assistant", GOOD))
    assert not await run_verifier("code_tests", t, {"tests": []})
    assert t.status == Status.FAILED and "non-empty list" in t.error


async def test_verifier_timeout_marks_failed():
    async def slow(trajectory, label):
        await asyncio.sleep(5)
        return 1.0

    t = traj(("assistant", "x"))
    assert not await run_verifier(slow, t, None, timeout=0.1)
    assert t.status == Status.FAILED and "timed out" in t.error
