"""The env checker: runs a user's env through reset/step/close and says exactly what it gets wrong.

    problems = await check_env(MyEnv, {"prompt": "2+2?", "label": "4"})   # [] when all is well
    await check_env(MyEnv(), task, raise_on_error=True)                    # EnvCheckError listing them

Like Gymnasium's ``env_checker``, but for the async, text-in/text-out contract of :mod:`agentrl.envs.base`:
sync methods (which would block every other episode), wrong return types, messages without a role or
content, tool-call records of the wrong type, a step that blocks the event loop, exceptions, an episode
that never ends, and a failing close.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import traceback
from typing import Any

from agentrl.types import ToolCallRecord

from .base import Env, StepResult

ROLES = {"system", "user", "assistant", "tool"}
OBSERVATION_FORMATS = {"message", "raw"}


class EnvCheckError(AssertionError):
    """The env breaks the contract; the message lists every problem found."""


def _exc(where: str, err: BaseException) -> str:
    tb = traceback.extract_tb(err.__traceback__)
    loc = f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{where} raised {type(err).__name__}: {err}{loc}"


def _check_messages(msgs: Any, where: str) -> list[str]:
    if not isinstance(msgs, list) or not msgs:
        return [
            f"{where} must return a non-empty list of message dicts, got {type(msgs).__name__}: {msgs!r:.80}"
        ]
    problems = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            problems.append(
                f"{where}: message {i} is {type(m).__name__}, expected a dict with role and content"
            )
            continue
        if m.get("role") not in ROLES:
            problems.append(
                f"{where}: message {i} has role {m.get('role')!r}; expected one of {sorted(ROLES)}"
            )
        if not isinstance(m.get("content"), str):
            problems.append(
                f"{where}: message {i} content must be str, got {type(m.get('content')).__name__}"
            )
    return problems


def _check_step(res: Any, i: int) -> list[str]:
    w = f"step() #{i}"
    if not isinstance(res, StepResult):
        return [f"{w} must return agentrl.envs.StepResult, got {type(res).__name__}: {res!r:.80}"]
    p = []
    if res.observation is not None and not isinstance(res.observation, str):
        p.append(f"{w}: observation must be str or None, got {type(res.observation).__name__}")
    if res.reward is not None and (isinstance(res.reward, bool) or not isinstance(res.reward, int | float)):
        p.append(f"{w}: reward must be a float or None, got {type(res.reward).__name__}")
    for flag in ("terminated", "truncated"):
        if not isinstance(getattr(res, flag), bool):
            p.append(f"{w}: {flag} must be bool, got {type(getattr(res, flag)).__name__}")
    if not isinstance(res.info, dict):
        p.append(f"{w}: info must be a dict, got {type(res.info).__name__}")
    if res.observation_role not in ROLES - {"assistant"}:
        p.append(f"{w}: observation_role {res.observation_role!r} must be 'tool', 'user' or 'system'")
    if res.observation_format not in OBSERVATION_FORMATS:
        p.append(
            f"{w}: observation_format {res.observation_format!r} must be one of {sorted(OBSERVATION_FORMATS)}"
        )
    if res.messages is not None:
        p += _check_messages(res.messages, f"{w} messages")
        if res.observation_format != "message":
            p.append(
                f"{w}: messages are chat messages, so observation_format must be 'message', not "
                f"{res.observation_format!r}; raw text continuing the assistant goes in observation"
            )
    calls = res.tool_calls
    if not isinstance(calls, list) or not all(isinstance(c, ToolCallRecord) for c in calls):
        p.append(f"{w}: tool_calls must be a list of agentrl.types.ToolCallRecord, got {calls!r:.80}")
    else:
        for j, c in enumerate(calls):
            if not isinstance(c.arguments, dict):
                p.append(f"{w}: tool_calls[{j}].arguments must be a dict, got {type(c.arguments).__name__}")
            if c.result is not None and not isinstance(c.result, str):
                p.append(f"{w}: tool_calls[{j}].result must be str or None, got {type(c.result).__name__}")
    # the rollout's test: an empty observation shows the model nothing, as a missing one does
    if not (res.terminated or res.truncated) and not res.observation and not res.messages:
        p.append(
            f"{w}: the episode goes on but there is no observation; return terminated=True or an observation"
        )
    return p


async def _timed(coro: Any, timeout: float, lags: list[float]) -> Any:
    """Await ``coro`` while a ticker measures how long the event loop was blocked."""
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            lags.append(now - last - 0.01)
            last = now

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        return await asyncio.wait_for(coro, timeout)
    finally:
        # one more tick so a coroutine that blocked without ever yielding is measured too
        await asyncio.sleep(0.011)
        stop.set()
        await t


async def check_env(
    env_or_cls: Env | type[Env] | Any,
    task: dict[str, Any],
    actions: list[str] | None = None,
    *,
    max_steps: int = 16,
    timeout: float = 30.0,
    max_block_s: float = 0.2,
    raise_on_error: bool = False,
) -> list[str]:
    """Run one episode of ``env_or_cls`` on ``task``; return the list of problems (empty: it passes).

    ``actions`` are the model outputs to feed, in order (the last one repeats); default: a plain text
    answer. A class is instantiated with no arguments. ``max_block_s``: the longest the event loop may be
    blocked by a single call before it is reported (a sync computation or I/O inside an async method).
    """
    problems: list[str] = []
    env = env_or_cls
    if inspect.isclass(env_or_cls):
        if not issubclass(env_or_cls, Env):
            problems.append(f"{env_or_cls.__name__} does not subclass agentrl.envs.Env")
        try:
            env = env_or_cls()
        except Exception as err:
            problems.append(
                _exc(f"{env_or_cls.__name__}()", err) + "; make every constructor argument optional"
            )
            return _finish(problems, raise_on_error)
    elif not isinstance(env, Env):
        problems.append(f"{type(env).__name__} does not subclass agentrl.envs.Env")
    for meth in ("reset", "step", "close"):
        fn = getattr(env, meth, None)
        if fn is None:
            problems.append(f"{meth}() is missing")
        elif not inspect.iscoroutinefunction(fn):
            problems.append(
                f"{meth}() must be `async def` (a sync {meth} blocks every other episode); "
                "move blocking work into `await asyncio.to_thread(...)`"
            )
    if problems and any("missing" in p or "async def" in p for p in problems):
        return _finish(problems, raise_on_error)
    stop = getattr(env, "stop", [])
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        problems.append(f"env.stop must be a list of str, got {stop!r:.80}")
    tools = getattr(env, "tools", None)
    if tools is not None and (
        not isinstance(tools, list)
        or not all(isinstance(t, dict) and t.get("type") == "function" and "function" in t for t in tools)
    ):
        problems.append(
            'env.tools must be None or a list of OpenAI schemas {"type": "function", "function": {...}}'
        )

    actions = list(actions or ["<answer>42</answer>"])
    lags: list[float] = []
    try:
        msgs = await _timed(env.reset(task), timeout, lags)
        problems += _check_messages(msgs, "reset()")
        ended = False
        for i in range(max_steps):
            action = actions[min(i, len(actions) - 1)]
            res = await _timed(env.step(action), timeout, lags)
            step_problems = _check_step(res, i + 1)
            problems += step_problems
            if step_problems or res.terminated or res.truncated:
                ended = not step_problems
                break
        else:
            problems.append(
                f"the episode did not end within {max_steps} steps; enforce a turn limit (truncated=True)"
            )
        if ended and lags and max(lags) > max_block_s:
            problems.append(
                f"the event loop was blocked for {max(lags):.2f}s inside reset()/step(); "
                "use `await asyncio.to_thread(...)` or async I/O for slow work"
            )
    except TimeoutError:
        problems.append(f"reset()/step() did not return within {timeout}s")
    except Exception as err:
        problems.append(_exc("reset()/step()", err))
    try:
        await asyncio.wait_for(env.close(), timeout)
    except Exception as err:
        problems.append(_exc("close()", err))
    return _finish(problems, raise_on_error)


def _finish(problems: list[str], raise_on_error: bool) -> list[str]:
    if problems and raise_on_error:
        raise EnvCheckError("env check failed:\n  - " + "\n  - ".join(problems))
    return problems
