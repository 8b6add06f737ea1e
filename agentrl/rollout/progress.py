"""The progress watch: a run that can never form a training batch stops, in bounded time, saying why.

The orchestrator feeds :class:`ProgressWatch` every training episode once its retries are over and
every group it keeps or drops. The watch answers with a :class:`~agentrl.buffer.NoProgressError` (the
orchestrator stops admitting and ``get_batch`` raises it) once waiting longer is hopeless:

* **nothing kept**: ``rollout.no_progress_groups`` groups in a row were dropped (zero variance, failed,
  stale, ...) and none kept; by default a whole pass over the dataset, at most 1,000 groups and at
  least two batches;
* **every episode failing**: ``rollout.no_progress_failures`` episodes in a row failed after their
  retries and none ended otherwise; by default two batches' worth (2 · batch_size · group_size), at
  least 32;
* **every tool call failing**: as many tool calls in a row came back with an error and none succeeded
  (a tool's server down: envs turn such failures into observations, so the episodes still end).

The error is one line: the cause, an example of the error text, and the config field to change. At a
failure rate of 10%, 32 failures in a row come once in 10^32 tries: the defaults are far from anything
a flaky but working run produces.
"""

from __future__ import annotations

import re
from collections import Counter

from agentrl.buffer import NoProgressError
from agentrl.types import Status, Trajectory

STREAM_PASS = 1_000  # groups that stand for "a whole pass" when the dataset's length is unknown
MIN_FAILURES = 32  # the smallest default of no_progress_failures


def failure_kind(traj: Trajectory) -> str:
    """What failed a trajectory, from its error text: ``env``, ``engine``, ``verifier``, ``reward``,
    ``tokenizer``, ``agent``, ``stale`` (the prefix the episode runners write)."""
    err = traj.error or ""
    if err.startswith("no reward"):
        return "reward"
    m = re.match(r"[a-z_]+", err)
    return m.group(0) if m else "unknown"


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failure_hint(kind: str, error: str) -> str:
    """What to change when every episode fails with ``kind``."""
    if kind == "engine" and ("EngineRequestError" in error or "answered 4" in error):
        return (
            "the engine refused every request: make the requests fit it (rollout.max_total_tokens or "
            "rollout.max_context_length against the engine's context length, rollout.sampling)"
        )
    return {
        "engine": "the engine failed every request: check the engines (engine.*) and their logs; "
        "rollout.engine_retries re-sends a request",
        "env": "the env raised in every episode: fix the env or what it calls (env.name, env.kwargs); "
        "rollout.env_step_timeout bounds one step",
        "verifier": "the verifier failed every episode: fix rollout.verifier (or the env's verifier), or "
        "raise rollout.verifier_timeout",
        "reward": "no episode got a reward: set rollout.verifier",
        "tokenizer": "the chat template or tokenizer failed every episode: check model_path's tokenizer and "
        "the env's messages",
        "agent": "the agent failed every episode: fix the agent (env.name, env.kwargs)",
        "stale": "every episode stayed too stale to train: raise rollout.max_staleness or "
        "rollout.max_stale_restarts; the engines must report the weight_version they were given",
    }.get(kind, "every episode failed: see the error")


class ProgressWatch:
    """See the module docstring. ``max_dropped`` / ``max_failures``: the two thresholds (0: off);
    ``tasks_per_pass``: the dataset's length, for the message (None: unknown)."""

    def __init__(self, max_dropped: int, max_failures: int, tasks_per_pass: int | None = None) -> None:
        self.max_dropped = max_dropped
        self.max_failures = max_failures
        self.tasks_per_pass = tasks_per_pass
        self.dropped: Counter[str] = Counter()  # groups dropped in a row, by reason
        self.rewards: Counter[float | None] = Counter()  # the one reward of each zero-variance group dropped
        self.failures: Counter[str] = Counter()  # episodes failed in a row, by kind
        self.last_error: dict[str, str] = {}  # kind (or reason) -> its latest error text
        self.tool_failures: Counter[str] = Counter()  # tool calls failed in a row, by tool
        self.last_tool_error = ""

    @classmethod
    def defaults(
        cls,
        batch_size: int,
        group_size: int,
        tasks_per_pass: int | None,
        groups: int | None = None,
        failures: int | None = None,
    ) -> ProgressWatch:
        """The watch of a run: ``groups`` / ``failures`` as configured, None for the defaults."""
        if groups is None:
            groups = max(2 * batch_size, min(tasks_per_pass or STREAM_PASS, STREAM_PASS))
        if failures is None:
            failures = max(MIN_FAILURES, 2 * batch_size * group_size)
        return cls(groups, failures, tasks_per_pass)

    # ---- feeding -----------------------------------------------------------------------------------
    def episode(self, traj: Trajectory) -> NoProgressError | None:
        """A training episode ended for good (after its retries)."""
        for turn in traj.turns:
            for call in getattr(turn, "tool_calls", None) or ():
                if call.name is None:  # the model wrote a call that does not parse: nothing ran
                    continue
                if call.error:
                    self.tool_failures[call.name] += 1
                    self.last_tool_error = f"{call.name}: {call.error}"
                else:
                    self.tool_failures.clear()
        if traj.status == Status.FAILED:
            kind = failure_kind(traj)
            self.failures[kind] += 1
            self.last_error[kind] = traj.error or kind
        else:
            self.failures.clear()
        return self._failing() or self._tools_failing()

    def kept(self) -> None:
        """A group was kept for training: progress."""
        self.dropped.clear()
        self.rewards.clear()

    def dropped_group(self, reason: str, trajs: list[Trajectory]) -> NoProgressError | None:
        """A group was dropped with ``reason``."""
        self.dropped[reason] += 1
        if reason == "zero_variance" and trajs:
            self.rewards[trajs[0].reward] += 1
        errors = [t.error for t in trajs if t.status == Status.FAILED and t.error]
        if errors:
            self.last_error[reason] = errors[-1]
        return self._nothing_kept()

    # ---- verdicts ----------------------------------------------------------------------------------
    def _failing(self) -> NoProgressError | None:
        n = sum(self.failures.values())
        if not self.max_failures or n < self.max_failures:
            return None
        kind, _ = self.failures.most_common(1)[0]
        error = self.last_error[kind]
        return NoProgressError(
            f"no progress: the last {n} episodes all failed after their retries "
            f"({self._counts(self.failures)}), e.g. {_one_line(error)!r}; {_failure_hint(kind, error)} "
            "(rollout.no_progress_failures sets how many failures in a row stop the run)"
        )

    def _tools_failing(self) -> NoProgressError | None:
        n = sum(self.tool_failures.values())
        if not self.max_failures or n < self.max_failures:
            return None
        return NoProgressError(
            f"no progress: the last {n} tool calls all failed and none succeeded "
            f"({self._counts(self.tool_failures)}), e.g. {_one_line(self.last_tool_error)!r}; is the tool's "
            "server up and reachable? check the env's settings (env.kwargs, e.g. retrieval_url) "
            "(rollout.no_progress_failures sets how many failures in a row stop the run)"
        )

    def _nothing_kept(self) -> NoProgressError | None:
        n = sum(self.dropped.values())
        if not self.max_dropped or n < self.max_dropped:
            return None
        span = f"{n} groups"
        if self.tasks_per_pass is not None and n >= self.tasks_per_pass:
            span += f", a whole pass over the {self.tasks_per_pass} tasks,"
        reason, _ = self.dropped.most_common(1)[0]
        if reason == "zero_variance":
            values = ", ".join(f"{r} in {c} groups" for r, c in self.rewards.most_common(3))
            hint = (
                f"every sample of a task got the same reward (reward {values}): check that the verifier "
                "tells answers apart (rollout.verifier, or the env's own), or train on such groups with "
                "rollout.filter_zero_variance=false"
            )
        elif reason.startswith("failed:"):
            kind = reason.split(":", 1)[1]
            error = self.last_error.get(reason, kind)
            hint = f"e.g. {_one_line(error)!r}; {_failure_hint(kind, error)}"
        elif reason == "stale":
            hint = _failure_hint("stale", "")
        else:
            hint = f"e.g. {_one_line(self.last_error.get(reason, reason))!r}; see the log"
        return NoProgressError(
            f"no progress: the last {span} were all dropped and none kept for training "
            f"({self._counts(self.dropped)}); {hint} (rollout.no_progress_groups sets how many dropped "
            "groups in a row stop the run)"
        )

    @staticmethod
    def _counts(counter: Counter[str]) -> str:
        return ", ".join(f"{k} {v}" for k, v in counter.most_common())
