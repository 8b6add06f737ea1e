"""Rollout counters and windowed rates, reported as flat ``{"rollout/...": number}`` dicts.

Cumulative counters (episodes, failures by kind, dropped groups by reason, retries, interrupts) never
reset; rates and distributions (turns/s, tokens/s, episode length and turns, tool latency, engine idle
fraction) cover the window since the previous :meth:`RolloutMetrics.snapshot`. The orchestrator feeds
it; :meth:`Orchestrator.stats` returns a snapshot and :meth:`Orchestrator.log_metrics` sends one to an
``agentrl.metrics.MetricsSink``.

Beside the numbers, a snapshot carries the text of the first failure of each kind,
``rollout/first_error/<kind>`` (a string; merging shards keeps the first shard's), so the driver can show it
on its console with the count (:class:`agentrl.metrics.FailureReport`): the episodes fail in the rollout's
workers, whose logs the driver's console does not show. Metric sinks keep only the numbers. The tools'
abandoned threads (sync tools past their timeout, :func:`agentrl.tools.base.tool_thread_counts`) are
``rollout/tool_threads_abandoned`` and ``rollout/tool_threads_abandoned_running``.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any

from agentrl.metrics import FIRST_ERROR
from agentrl.tools.base import tool_thread_counts

ERROR_TEXT_CHARS = 300


def one_line(text: str, limit: int = ERROR_TEXT_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


class RolloutMetrics:
    """See the module docstring."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # by kind: env, engine, verifier, reward, internal
        self.dropped: Counter[str] = Counter()  # groups, by reason
        self.first_errors: dict[str, str] = {}  # kind -> the text of its first failure
        self._t_window = time.monotonic()
        self._turns = 0
        self._model_tokens = 0
        self._obs_tokens = 0
        self._ep_len: list[float] = []
        self._ep_turns: list[float] = []
        self._tool_latency: list[float] = []
        self._gen_latency: list[float] = []
        # engine busy time: integrated while at least one /generate is in flight
        self._inflight = 0
        self._busy_since: float | None = None
        self._busy = 0.0

    # ---- feeding -----------------------------------------------------------------------------------
    def request_started(self, input_tokens: int = 0) -> None:
        self.counters["requests"] += 1
        self.counters["request_input_tokens"] += input_tokens
        if self._inflight == 0:
            self._busy_since = time.monotonic()
        self._inflight += 1

    def request_ended(self, latency: float) -> None:
        self._inflight -= 1
        self._gen_latency.append(latency)
        if self._inflight == 0 and self._busy_since is not None:
            self._busy += time.monotonic() - self._busy_since
            self._busy_since = None

    @property
    def inflight_requests(self) -> int:
        return self._inflight

    def turn(self, model_tokens: int) -> None:
        self._turns += 1
        self._model_tokens += model_tokens
        self.counters["turns"] += 1
        self.counters["model_tokens"] += model_tokens

    def observation(self, tokens: int) -> None:
        self._obs_tokens += tokens
        self.counters["observation_tokens"] += tokens

    def tool(self, seconds: float) -> None:
        self._tool_latency.append(seconds)

    def episode(self, status: str, length: int, turns: int) -> None:
        self.counters["episodes"] += 1
        self.counters[f"episodes_{status}"] += 1
        self._ep_len.append(length)
        self._ep_turns.append(turns)

    def failure(self, kind: str, error: str | BaseException | None = None) -> None:
        """Count a failure of ``kind``; the first of each kind keeps its text: ``error``, or the exception
        being handled where this is called from an ``except`` block (``kind: Type: message``)."""
        self.failures[kind] += 1
        if kind in self.first_errors:
            return
        if error is None:
            error = sys.exc_info()[1]
        if isinstance(error, BaseException):
            error = f"{kind}: {type(error).__name__}: {error}"
        if error:
            self.first_errors[kind] = one_line(error)

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] += n

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    # ---- reading -----------------------------------------------------------------------------------
    def snapshot(self, reset_window: bool = True, **gauges: float) -> dict[str, Any]:
        now = time.monotonic()
        dt = max(now - self._t_window, 1e-9)
        busy = self._busy + ((now - self._busy_since) if self._busy_since is not None else 0.0)
        out: dict[str, Any] = {
            "rollout/turns_per_s": self._turns / dt,
            "rollout/model_tokens_per_s": self._model_tokens / dt,
            "rollout/observation_tokens_per_s": self._obs_tokens / dt,
            "rollout/episode_len_mean": sum(self._ep_len) / len(self._ep_len) if self._ep_len else 0.0,
            "rollout/episode_len_max": max(self._ep_len, default=0.0),
            "rollout/episode_turns_mean": sum(self._ep_turns) / len(self._ep_turns)
            if self._ep_turns
            else 0.0,
            "rollout/tool_latency_mean_s": sum(self._tool_latency) / len(self._tool_latency)
            if self._tool_latency
            else 0.0,
            "rollout/tool_latency_p90_s": _pct(self._tool_latency, 0.9),
            "rollout/generate_latency_mean_s": sum(self._gen_latency) / len(self._gen_latency)
            if self._gen_latency
            else 0.0,
            "rollout/engine_idle_frac": max(0.0, 1.0 - busy / dt),
            "rollout/inflight_requests": self._inflight,
        }
        for k, v in self.counters.items():
            out[f"rollout/{k}"] = v
        if "cached_input_tokens" in self.counters and self.counters["request_input_tokens"]:
            # since the start: the share of the tokens sent to /generate that the engine's prefix cache served
            out["rollout/prefix_cache_hit_rate"] = (
                self.counters["cached_input_tokens"] / self.counters["request_input_tokens"]
            )
        for k, v in self.failures.items():
            out[f"rollout/failures/{k}"] = v
        out["rollout/failures_total"] = sum(self.failures.values())
        for k, text in self.first_errors.items():
            out[FIRST_ERROR + k] = text
        for k, n in tool_thread_counts().items():
            out[f"rollout/tool_threads_{k}"] = n
        for k, v in self.dropped.items():
            out[f"rollout/dropped_groups/{k}"] = v
        out["rollout/dropped_groups_total"] = sum(self.dropped.values())
        for k, v in gauges.items():
            out[f"rollout/{k}"] = v
        if reset_window:
            self._t_window = now
            self._turns = self._model_tokens = self._obs_tokens = 0
            self._ep_len, self._ep_turns, self._tool_latency, self._gen_latency = [], [], [], []
            self._busy = 0.0
            if self._busy_since is not None:
                self._busy_since = now
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters),
            "failures": dict(self.failures),
            "dropped": dict(self.dropped),
            "first_errors": dict(self.first_errors),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters = Counter(state.get("counters", {}))
        self.failures = Counter(state.get("failures", {}))
        self.dropped = Counter(state.get("dropped", {}))
        self.first_errors = dict(state.get("first_errors", {}))
