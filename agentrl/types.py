"""The Trajectory record: one token-exact episode, shared by every component.

A trajectory holds the prompt token ids and everything after them as one flat ``response_ids`` list:
model-sampled tokens (``loss_mask`` 1) interleaved with observation tokens (``loss_mask`` 0) that the
orchestrator tokenized once and appended. Per response token it keeps the rollout logprob and the policy
version that produced it (observation tokens: logprob 0.0, version -1), so a trajectory interrupted by a
weight update carries mixed versions. ``turns`` records which slice of ``response_ids`` each turn is, and
on a model turn the tool calls the env executed for it (:class:`ToolCallRecord`, as the env reported them).
A row of a tree rollout (:mod:`agentrl.rollout.tree`) says where it sits in its task's tree
(:class:`TreePosition`): the response tokens before a branch offset are the same ids in every row below
that branch point.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    """How an episode ended."""

    COMPLETED = "completed"  # the env terminated it normally
    TRUNCATED = "truncated"  # max turns, max tokens or the model's context length
    ABORTED = "aborted"  # cancelled (shutdown, or an interrupted episode configured not to resume)
    FAILED = "failed"  # an env, tool, verifier or engine error; `error` says which


OBSERVATION_VERSION = -1  # policy_versions entry of a loss_mask-0 token
# the per-token lists of a Trajectory (ints and floats: a shallow copy is a whole copy)
_TOKEN_LISTS = frozenset({"prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "policy_versions"})


@dataclass
class ToolCallRecord:
    """One tool call as the env executed it: what was called with what, what came back, how long it took."""

    name: str | None  # None: a call the env could not parse (``error`` says why); nothing ran
    arguments: dict[str, Any] = field(default_factory=dict)
    result: str | None = None  # the tool's output (None when the call failed)
    error: str | None = None  # why the call failed (None when it succeeded)
    latency_s: float | None = None  # wall time of the call itself (None: not measured)
    id: str | None = None  # the call id, in formats that have one


@dataclass
class Turn:
    """One slice ``response_ids[start:end]``: a model action or an observation."""

    role: str  # "assistant" (sampled, loss_mask 1) or "observation" (env/tool output, loss_mask 0)
    start: int
    end: int
    text: str = ""
    # on an assistant turn: the calls the env executed for this action, in order (empty: none recorded)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)


@dataclass
class TreePosition:
    """Where a leaf of a tree rollout sits in its tree: the child it took at each branch point, root first.

    ``branch_offsets[d]`` is the ``response_ids`` offset at which branch point ``d`` forked the episode:
    ``response_ids[:branch_offsets[d]]`` is shared, id for id, with every leaf whose ``path`` starts with
    ``path[:d]``; ``branch_turns[d]`` is the model turn (1-based) after which it forked, 0 for the
    prompt (a tree whose root ended early and was sampled again from there).
    """

    tree_id: str  # one tree per group member: "<group id>/<sample index>"
    path: list[int] = field(default_factory=list)
    branch_turns: list[int] = field(default_factory=list)
    branch_offsets: list[int] = field(default_factory=list)


@dataclass
class Trajectory:
    """One episode, token-exact. See the module docstring for the invariants."""

    task_id: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    status: Status = Status.COMPLETED
    error: str | None = None
    sample_index: int = 0
    # rows of one episode share it when the episode yielded several (an agent's forks or drift
    # splits): GRPO then counts the episode once in its group. None: this row is its own episode.
    episode_id: str | None = None
    label: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # MoE models: the experts the engine routed each input position to, as SGLang's
    # meta_info["routed_experts"] carries them (base64 of int32 [tokens, layers, k]; the latest turn's
    # record, which covers every token but the last). The trainer replays it (trainer.moe.routing_replay).
    routed_experts: str | None = None
    # tree rollouts: this leaf's place in its task's tree (None: a flat episode)
    tree: TreePosition | None = None

    # ---- building -------------------------------------------------------------------------------
    def append_model_tokens(
        self, ids: list[int], logprobs: list[float], version: int | list[int], text: str = ""
    ) -> None:
        """Append sampled tokens (loss_mask 1) as one assistant turn."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} token ids but {len(logprobs)} logprobs")
        versions = [version] * len(ids) if isinstance(version, int) else list(version)
        if len(versions) != len(ids):
            raise ValueError(f"{len(ids)} token ids but {len(versions)} versions")
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.rollout_logprobs.extend(float(x) for x in logprobs)
        self.policy_versions.extend(versions)
        self.turns.append(Turn("assistant", start, len(self.response_ids), text))

    def append_observation_tokens(self, ids: list[int], text: str = "") -> None:
        """Append env/tool output tokens (loss_mask 0), tokenized once by the caller."""
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.rollout_logprobs.extend([0.0] * len(ids))
        self.policy_versions.extend([OBSERVATION_VERSION] * len(ids))
        self.turns.append(Turn("observation", start, len(self.response_ids), text))

    # ---- reading --------------------------------------------------------------------------------
    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def num_turns(self) -> int:
        return sum(1 for t in self.turns if t.role == "assistant")

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def min_policy_version(self) -> int | None:
        """Oldest policy version among model tokens (None when the model produced no token)."""
        versions = [v for v, m in zip(self.policy_versions, self.loss_mask, strict=True) if m]
        return min(versions) if versions else None

    def assistant_text(self) -> str:
        """The model's own text, observations left out (what verifiers score)."""
        return "".join(t.text for t in self.turns if t.role == "assistant")

    @property
    def final_answer(self) -> str | None:
        """The episode's final answer: the env's ``info["answer"]`` when it parsed one (the built-in envs do:
        ``tool``/``python`` the last turn's text without a call, ``search`` the ``<answer>`` content), else
        the text of the last model turn when the env ran no tool call for it; None when the episode ended
        on a tool call or without a model turn."""
        answer = self.info.get("answer")
        if isinstance(answer, str):
            return answer
        last = next((t for t in reversed(self.turns) if t.role == "assistant"), None)
        return last.text if last is not None and not last.tool_calls else None

    def tool_results(self, name: str | None = None) -> list[ToolCallRecord]:
        """The tool calls the env ran, in order, each with its ``arguments`` and its ``result`` (or its
        ``error``), as the env reported them (``StepResult.tool_calls``); ``name``: only that tool's. Calls
        the env could not parse ran nothing and are left out (they stay on their turn's ``tool_calls``)."""
        return [
            c
            for t in self.turns
            for c in t.tool_calls
            if c.name is not None and (name is None or c.name == name)
        ]

    def validate(self) -> None:
        """Raise ValueError when per-token lists disagree or turns do not tile the response."""
        n = len(self.response_ids)
        for name in ("loss_mask", "rollout_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.task_id}: {name} has "
                    f"{len(getattr(self, name))} entries, response has {n}"
                )
        pos = 0
        for t in self.turns:
            if t.start != pos or t.end < t.start:
                raise ValueError(f"trajectory {self.task_id}: turns do not tile the response at {pos}")
            pos = t.end
        if pos != n:
            raise ValueError(f"trajectory {self.task_id}: turns cover {pos} of {n} response tokens")

    # ---- serialization --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A plain dict of fresh containers (what ``dataclasses.asdict`` gives, status as its value); the
        token lists are copied whole, not element by element as ``asdict`` does, which took most of the
        time of sending a batch to the trainer."""
        d: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _TOKEN_LISTS:
                d[f.name] = list(value)
            elif f.name == "turns":
                d[f.name] = [asdict(t) for t in value]
            elif f.name == "tree":
                d[f.name] = None if value is None else asdict(value)
            else:
                d[f.name] = copy.deepcopy(value)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        d["status"] = Status(d.get("status", "completed"))
        d["turns"] = [_turn(t) for t in d.get("turns", [])]
        if d.get("tree") is not None:
            d["tree"] = TreePosition(**d["tree"])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str) -> Trajectory:
        return cls.from_dict(json.loads(s))


def _turn(d: dict[str, Any]) -> Turn:
    calls = [ToolCallRecord(**c) for c in d.get("tool_calls", [])]
    return Turn(**{**d, "tool_calls": calls})
