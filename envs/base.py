"""The Env contract: an async, multi-turn environment the orchestrator drives one action at a time.

``await env.reset(task)`` returns the initial chat messages; the orchestrator applies the chat template,
samples the model's action, and calls ``await env.step(action_text)``, which returns a :class:`StepResult`
whose ``observation`` is either text (appended as a tool/user message) or ``None``. ``reward`` may be
given at the end (else a verifier scores the trajectory: ``rollout.verifier``, or the env's own
``verifier``; an env that always gives its reward says so with ``scores_itself``). ``await env.close()``
always runs.

How the orchestrator appends an observation (it tokenizes the observation on its own, loss_mask 0):

* ``observation_format="message"`` (default): a chat message of role ``observation_role`` rendered with
  the chat template (Qwen: ``<|im_start|>user\n<tool_response>...``), after the assistant turn is closed.
* ``observation_format="raw"``: the text verbatim, no chat template, continuing the assistant's own
  message (Search-R1 appends ``\n\n<information>...</information>\n\n`` right after ``</search>``).

``messages`` (optional) carries several observation messages at once, e.g. one tool message per call of
a multi-call turn. When it is set, the model sees exactly these messages, rendered together by the chat
template (``observation_format`` must be ``"message"``), and ``observation`` is optional: when given it
should hold the same content joined, for consumers that want one text.

``tool_calls`` (optional) says which tool calls the step executed, each a
:class:`~agentrl.types.ToolCallRecord` (name, arguments, result or error, latency). The episode runner
stores them on the model turn the step answered, and episode dumps and the viewer show them; the env is
the only part that knows its call format, so nothing re-parses the model's text. An env that records
none still works: its dumps show no calls.

Tree rollouts (``rollout.tree``) fork an episode mid-way. An env forks when it implements ``fork()`` (a
copy in its current state, sync or async), or when it is ``deterministic`` (the same task and action
texts always give the same observations): the platform then replays the episode into a fresh env.
:mod:`agentrl.envs.fork` does both and refuses, at load, an env that is neither.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from agentrl.types import ToolCallRecord

Message = dict[str, Any]  # {"role": "system"|"user"|"assistant"|"tool", "content": str, ...}


@dataclass
class StepResult:
    """What one env step returns."""

    observation: str | None = None  # text to show the model next (None: nothing to add)
    reward: float | None = None  # terminal reward, or None to let the verifier decide
    terminated: bool = False  # the episode ended normally (an answer was given)
    truncated: bool = False  # the env cut the episode short (e.g. it ran out of turns)
    info: dict[str, Any] = field(default_factory=dict)
    observation_role: str = "tool"  # chat role for the observation ("tool" or "user")
    # "message": render as a chat message of observation_role; "raw": append the text verbatim, continuing
    # the assistant message (no chat template), as Search-R1 does. See the module docstring.
    observation_format: str = "message"
    # several observation messages (e.g. one per tool call), shown to the model instead of `observation`
    messages: list[Message] | None = None
    # the tool calls this step executed, in order (see the module docstring)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)


class Env(ABC):
    """Base class of every env. Subclasses implement ``reset`` and ``step``; ``close`` is optional.

    A task is a dict; by convention ``task["prompt"]`` (str or messages) and ``task["label"]`` (what the
    verifier compares against). Everything is async: blocking work belongs in ``asyncio.to_thread``.
    """

    #: chat-template stop strings the engine should stop at (e.g. ``["</search>", "</answer>"]``)
    stop: list[str] = []
    #: OpenAI-format tool schemas passed to the chat template, if the env uses native tool calls
    tools: list[dict[str, Any]] | None = None
    #: name of the verifier that scores this env's episodes when the config names none (None: the config's)
    verifier: str | None = None
    #: True when the env itself always ends an episode with a ``StepResult.reward``: it needs no verifier
    scores_itself: bool = False
    #: True when the same task and the same action texts always give the same observations: a tree
    #: rollout then forks the env by replaying the episode into a fresh one (when it has no ``fork``)
    deterministic: bool = False

    @abstractmethod
    async def reset(self, task: dict[str, Any]) -> list[Message]:
        """Start an episode for ``task``; return the initial messages."""

    @abstractmethod
    async def step(self, action_text: str) -> StepResult:
        """Apply the model's action text; return the observation and whether the episode is over."""

    def fork(self) -> Env | Awaitable[Env]:
        """Optional: a new env in this one's current state, for a tree rollout's branch (see
        :mod:`agentrl.envs.fork`); async when copying the state needs I/O. The fork is closed on its
        own, so it must own (or share read-only) everything ``close`` releases."""
        raise NotImplementedError(f"{type(self).__name__} does not fork")

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (sandboxes, sessions). Called once per episode, also after errors."""
