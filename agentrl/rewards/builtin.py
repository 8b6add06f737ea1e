"""Built-in verifiers: ``exact_match``, ``f1``, ``math`` and ``code_tests``.

All score the model's own text (``trajectory.assistant_text()``: observations such as retrieved passages
are left out, and the prompt never counts). Gold labels may be a string, a list of strings, or a dict with
``target`` (the Search-R1 parquet ``ground_truth``). A missing answer is a legitimate 0.0; a verifier that
cannot work (bad label, broken sandbox) raises, and :func:`~agentrl.rewards.base.run_verifier` marks the
trajectory FAILED with that error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import string
from collections import Counter
from typing import Any

from agentrl.rewards.base import RewardResult, register_verifier
from agentrl.types import Trajectory

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_CODE_BLOCK = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


# ---- text helpers -------------------------------------------------------------------------------
def normalize_answer(s: str) -> str:
    """SQuAD normalization: lowercase, drop punctuation and the articles a/an/the, squeeze whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def extract_answer(text: str) -> str | None:
    """Content of the LAST ``<answer>...</answer>`` block (None when there is none)."""
    found = _ANSWER.findall(text or "")
    return found[-1].strip() if found else None


def gold_answers(label: Any) -> list[str]:
    """Gold answers as a list of strings from str | list | tuple | {"target": ...} | array-likes."""
    if isinstance(label, dict):
        for key in ("target", "ground_truth", "answers", "answer"):
            if key in label:
                return gold_answers(label[key])
        raise ValueError(f"label dict has none of target/ground_truth/answers/answer: {sorted(label)}")
    if hasattr(label, "tolist") and not isinstance(label, str):  # numpy arrays from parquet rows
        label = label.tolist()
    if isinstance(label, str | int | float) and not isinstance(label, bool):
        return [str(label)]
    if isinstance(label, list | tuple) and label and all(isinstance(x, str | int | float) for x in label):
        return [str(x) for x in label]
    raise ValueError(f"cannot read gold answers from label {label!r:.120}")


def _text(trajectory: Trajectory | str) -> str:
    return trajectory if isinstance(trajectory, str) else trajectory.assistant_text()


# ---- exact match / F1 (Search-R1) ---------------------------------------------------------------
def em_score(prediction: str, golds: list[str]) -> float:
    p = normalize_answer(prediction)
    return 1.0 if any(p == normalize_answer(g) for g in golds) else 0.0


def f1_score(prediction: str, golds: list[str]) -> float:
    """Token-level F1 (SQuAD), best over the gold answers."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for g in golds:
        gold = normalize_answer(g).split()
        common = Counter(pred) & Counter(gold)
        same = sum(common.values())
        if not pred or not gold:
            best = max(best, float(pred == gold))
        elif same:
            precision, recall = same / len(pred), same / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


@register_verifier("exact_match")
async def exact_match_verifier(trajectory: Trajectory | str, label: Any) -> RewardResult:
    """1.0 when the last ``<answer>`` of the response equals a gold answer after SQuAD normalization."""
    golds = gold_answers(label)
    answer = extract_answer(_text(trajectory))
    if answer is None:
        return RewardResult(0.0, {"em": 0.0, "has_answer": 0.0})
    em = em_score(answer, golds)
    return RewardResult(em, {"em": em, "has_answer": 1.0})


@register_verifier("f1")
async def f1_verifier(trajectory: Trajectory | str, label: Any) -> RewardResult:
    """Token F1 of the last ``<answer>`` against the best gold answer."""
    golds = gold_answers(label)
    answer = extract_answer(_text(trajectory))
    if answer is None:
        return RewardResult(0.0, {"f1": 0.0, "has_answer": 0.0})
    f1 = f1_score(answer, golds)
    return RewardResult(f1, {"f1": f1, "has_answer": 1.0})


# ---- math (math-verify) -------------------------------------------------------------------------
def math_equal(prediction: str, gold: str) -> bool:
    """math-verify equivalence of a model answer (any text; the last boxed/latex/expression) and a gold."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call with timeouts off
    # math-verify's own timeouts use SIGALRM, which only works in the main thread; we run in a worker
    # thread and bound the time in run_verifier instead.
    gold_parsed = parse(gold if "$" in gold else f"${gold}$", parsing_timeout=None)
    if not gold_parsed:
        gold_parsed = parse(gold, parsing_timeout=None)
    if not gold_parsed:
        raise ValueError(f"math-verify cannot parse the gold answer {gold!r}")
    pred_parsed = parse(prediction, parsing_timeout=None)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


@register_verifier("math")
async def math_verifier(trajectory: Trajectory | str, label: Any) -> RewardResult:
    """1.0 when the response's final answer is mathematically equal to the gold (math-verify).

    The answer is the last ``<answer>`` block when there is one, else the whole response (math-verify
    then takes the last ``\\boxed{}``/LaTeX/expression in it).
    """
    golds = gold_answers(label)
    text = _text(trajectory)
    answer = extract_answer(text)
    candidate = answer if answer is not None else text
    ok = await asyncio.to_thread(lambda: any(math_equal(candidate, g) for g in golds))
    return RewardResult(float(ok), {"math": float(ok)})


# ---- code tests ---------------------------------------------------------------------------------
# Runs inside the sandbox. Each test runs in its own child process: the solution, then the test, then a
# line echoing a per-test nonce the child reads from stdin (reversed). A solution that exits early
# (``os._exit(0)``) or prints a fake report therefore does not pass: only the harness's own last line
# counts, and a child only passes by running to the end of its test.
_HARNESS = r"""
import json, secrets, subprocess, sys
tests = json.load(open("tests.json"))
solution = open("solution.py").read()
limit = float(sys.argv[1])
report = {"passed": 0, "total": len(tests), "errors": []}
for i, test in enumerate(tests):
    nonce = secrets.token_hex(16)
    src = solution + "\n\n" + test + "\nimport sys as _s\nprint(_s.stdin.readline().strip()[::-1])\n"
    with open(f"test_{i}.py", "w") as f:
        f.write(src)
    try:
        p = subprocess.run([sys.executable, f"test_{i}.py"], input=nonce + "\n", capture_output=True,
                           text=True, timeout=limit)
        ok = p.returncode == 0 and p.stdout.rstrip().endswith(nonce[::-1])
        if not ok:
            last = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
            report["errors"].append(f"test {i}: " + last)
    except subprocess.TimeoutExpired:
        ok = False
        report["errors"].append(f"test {i}: timed out after {limit}s")
    report["passed"] += int(ok)
print("\n__AGENTRL_REPORT__" + json.dumps(report))
"""


def extract_code(text: str) -> str | None:
    """The last fenced code block (```python ... ```) of the response, else the last ``<answer>``."""
    blocks = _CODE_BLOCK.findall(text or "")
    if blocks:
        return blocks[-1]
    return extract_answer(text)


@register_verifier("code_tests")
async def code_tests_verifier(trajectory: Trajectory | str, label: Any, sandbox: Any = None) -> RewardResult:
    """Fraction of the label's tests the response's code passes, run in a sandbox.

    Label: ``{"tests": ["assert f(1) == 2", ...] | "one test script", "test_timeout": 5, "sandbox": "auto"}``
    (a bare list or string is the tests). The solution is the last fenced code block of the response.
    Each test runs in its own process after the solution. Code that crashes, hangs or
    exhausts memory scores 0; a sandbox that does not work raises (the trajectory is then FAILED).
    """
    from agentrl.sandboxes.shared import shared_sandbox

    cfg = label if isinstance(label, dict) else {"tests": label}
    tests = cfg.get("tests")
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"code_tests label needs 'tests': a non-empty list of str, got {tests!r:.120}")
    code = extract_code(_text(trajectory))
    if code is None:
        return RewardResult(0.0, {"pass_rate": 0.0, "has_code": 0.0})
    sb = sandbox or shared_sandbox(cfg.get("sandbox"))
    files = {"solution.py": code, "tests.json": json.dumps(tests)}
    per_test = float(cfg.get("test_timeout", 5.0))
    total = float(cfg.get("timeout", per_test * len(tests) + 5.0))
    result = await sb.run(
        command=["python3", "harness.py", str(per_test)],
        files={**files, "harness.py": _HARNESS},
        timeout=total,
    )
    marker = result.stdout.rfind("__AGENTRL_REPORT__")
    if marker == -1:  # killed (timeout, memory) or the output flood cut the report: the code failed
        if result.killed_reason and result.killed_reason.startswith("sandbox_error"):
            raise RuntimeError(f"code_tests sandbox failed: {result.killed_reason}")
        return RewardResult(0.0, {"pass_rate": 0.0, "has_code": 1.0, "timed_out": float(result.timed_out)})
    report = json.loads(result.stdout[marker + len("__AGENTRL_REPORT__") :].strip().splitlines()[0])
    rate = report["passed"] / max(report["total"], 1)
    return RewardResult(rate, {"pass_rate": rate, "has_code": 1.0, "all_passed": float(rate == 1.0)})
