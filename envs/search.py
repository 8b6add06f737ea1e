"""SearchEnv: Search-R1's multi-turn retrieval format, byte for byte, against a ``/retrieve`` server.

The prompt is Search-R1's (typo "as your want" included, because trained checkpoints expect it). Each
model turn ends at ``</search>`` or ``</answer>`` (``stop``); the first ``<search>`` or ``<answer>``
block decides:

* search: the query goes to the retrieval server; ``\\n\\n<information>{docs}</information>\\n\\n`` is
  appended with each passage as ``Doc {i}(Title: {title}) {text}\\n``;
* answer: the episode ends (the ``exact_match`` verifier scores the last ``<answer>`` of the response);
* neither: the invalid-action message is appended.

After ``max_turns`` searching turns the model gets one final turn in which searches are no longer run.
Observations continue the assistant's own text (``observation_format="raw"``, as Search-R1 does); set
``observation_format="message"`` to send them as user messages instead. The action text must contain the
stop string (SGLang ``no_stop_trim=True``); when an engine trimmed it, the open tag at the very end is
closed again (``complete_trimmed_stop``). Each search that ran is reported in ``StepResult.tool_calls``
(a ``search`` call with its query, the passages or the failure, and its latency).
"""

from __future__ import annotations

import asyncio
import copy
import re
import time
import weakref
from typing import Any, Literal

from agentrl.tools.parsers import parse_search_r1
from agentrl.tools.search import RetrievalClient
from agentrl.types import ToolCallRecord

from .base import Env, Message, StepResult
from .registry import register_env

PROMPT = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> "
    "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)
INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
STOP = ["</search>", "</answer>"]
_TRIMMED = re.compile(r"<(search|answer)>(?:(?!</\1>|<search>|<answer>).)*\Z", re.DOTALL)

_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple, RetrievalClient]] = (
    weakref.WeakKeyDictionary()
)
_CLOSERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()


def _shared_client(url: str, topk: int, timeout: float, api_key: str | None) -> RetrievalClient:
    """One HTTP connection pool per event loop and server, shared by all episodes (a session per episode
    served 30% fewer searches in waves of a hundred), closed when the loop shuts down."""
    loop = asyncio.get_running_loop()
    per_loop = _CLIENTS.get(loop)
    if per_loop is None:
        per_loop = _CLIENTS[loop] = {}
        _CLOSERS[loop] = _close_at_shutdown(per_loop)
    key = (url, topk, timeout, api_key)
    if key not in per_loop:
        per_loop[key] = RetrievalClient(url, topk=topk, timeout=timeout, api_key=api_key)
    return per_loop[key]


def _close_at_shutdown(clients: dict[tuple, RetrievalClient]) -> Any:
    """An async generator parked at its ``yield`` on the running loop: the loop's shutdown of its async
    generators (``asyncio.run`` runs it before closing the loop) resumes it into ``finally``, which closes
    ``clients`` on that loop. Returned, to be kept as long as the loop."""

    async def parked():
        try:
            yield
        finally:
            for client in list(clients.values()):
                await client.close()
            clients.clear()

    closer = parked()
    try:  # its first step (which registers it with the running loop) runs to the yield, no await
        closer.asend(None).send(None)
    except StopIteration:
        pass
    return closer


def format_prompt(question: str) -> str:
    return PROMPT.format(question=question.strip())


@register_env("search")
class SearchEnv(Env):
    """Search-R1 tool use. Task: ``{"question": str}`` or a Search-R1 parquet row (``prompt`` messages)."""

    stop = STOP
    verifier = "exact_match"

    def __init__(
        self,
        retrieval_url: str = "http://127.0.0.1:8000",
        topk: int = 3,
        max_turns: int = 4,
        observation_format: Literal["raw", "message"] = "raw",
        timeout: float = 30.0,
        complete_trimmed_stop: bool = True,
        retriever: RetrievalClient | None = None,
        retrieval_api_key: str | None = None,
    ) -> None:
        if max_turns < 0 or topk < 1:
            raise ValueError(f"need max_turns >= 0 and topk >= 1, got {max_turns}, {topk}")
        self.retrieval_url, self.topk, self.max_turns, self.timeout = retrieval_url, topk, max_turns, timeout
        self.observation_format = observation_format
        self.complete_trimmed_stop = complete_trimmed_stop
        self._retriever = retriever
        self.retrieval_api_key = retrieval_api_key  # the server's key, when it requires one
        self.turn = 0
        self.num_searches = 0

    def fork(self) -> SearchEnv:
        """A copy in the current state (turn and search counters); the retrieval client is shared."""
        return copy.copy(self)

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.turn = 0
        self.num_searches = 0
        question = task.get("question")
        prompt = task.get("prompt")
        if question is None and isinstance(prompt, list):
            return [dict(m) for m in prompt]  # a Search-R1 parquet row: the prompt is already formatted
        question = question if question is not None else prompt
        if not isinstance(question, str):
            raise ValueError(f"SearchEnv task needs a 'question' (str) or 'prompt'; got keys {sorted(task)}")
        return [{"role": "user", "content": format_prompt(question)}]

    def _observe(
        self, text: str, info: dict[str, Any], calls: list[ToolCallRecord] | None = None
    ) -> StepResult:
        return StepResult(
            text,
            info=info,
            observation_role="user",
            observation_format=self.observation_format,
            tool_calls=calls or [],
        )

    async def step(self, action_text: str) -> StepResult:
        t = self.turn
        self.turn += 1
        action = parse_search_r1(action_text)
        if action.kind == "invalid" and self.complete_trimmed_stop and isinstance(action_text, str):
            m = _TRIMMED.search(action_text)
            if m:  # the engine trimmed the stop string: close the tag the model was in
                action = parse_search_r1(action_text + f"</{m.group(1)}>")
        info: dict[str, Any] = {"action": action.kind, "turn": t, "num_searches": self.num_searches}
        if action.kind == "answer":
            info["answer"] = action.content
            return StepResult(None, terminated=True, info=info)
        if t >= self.max_turns:  # the final turn: no more searches
            info["reason"] = "max_turns"
            return StepResult(None, truncated=True, info=info)
        if action.kind == "invalid":
            return self._observe(INVALID_ACTION, info)
        retriever = self._retriever or _shared_client(
            self.retrieval_url, self.topk, self.timeout, self.retrieval_api_key
        )
        call = ToolCallRecord("search", {"query": action.content})
        t0 = time.monotonic()
        try:
            docs = call.result = await retriever.search(action.content, self.topk)
        except Exception as err:  # the episode goes on; the model sees the failure, the info records it
            info["tool_error"] = call.error = f"{type(err).__name__}: {err}"
            docs = f"Search failed: {type(err).__name__}: {err}"
        call.latency_s = time.monotonic() - t0
        self.num_searches += 1
        info["num_searches"] = self.num_searches
        info["query"] = action.content
        return self._observe(f"\n\n<information>{docs.strip()}</information>\n\n", info, [call])
