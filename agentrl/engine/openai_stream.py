"""Streamed OpenAI answers (``stream: true``): server-sent events whose content goes out as tokens arrive.

The front end (:mod:`agentrl.engine.openai_api`) starts a request's ``n`` generations as
:class:`Generations`, each with a token hook that puts the newly sampled ids on one queue. The answer
waits for the first sign of life (a token, or a generation that ended), so a request refused before
sampling anything is still a plain OpenAI error with its status. Then the events go out:

* per choice, a first chunk with the assistant role;
* content deltas as tokens arrive: :class:`StableText` decodes all ids so far and sends only text that
  later tokens cannot change (see its docstring), so multi-byte characters and merged pieces are never
  split wrongly and the deltas add up to the non-streamed content exactly;
* when a choice's generation ends: the rest of its content, its tool calls (parsed from the whole text,
  as without streaming), and its ``finish_reason`` with the choice's ``logprobs``;
* the usage chunk (with ``stream_options.include_usage``) and ``[DONE]``.

A backend that cannot stream (the rollout's recording proxy: one ``/generate`` per call) simply calls no
hook, and the whole completion goes out when it ends. Closing the stream early (the client went away)
cancels the generations, and the backend aborts them in the engine. An error after the first event is
sent as an ``{"error": ...}`` event, which the openai SDK raises.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from agentrl.chat import ChatTokenizer
from agentrl.engine.openai_request import OpenAIError

log = logging.getLogger(__name__)

_WINDOW = 32  # tokens decoded again on every push at most twice this (see StableText._decoded)
_TOOL_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker`` (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class StableText:
    """Incremental detokenization of one completion: the part of its text that later tokens cannot change.

    Each :meth:`push` decodes the ids so far the way the final answer does and returns the new part of
    the stable prefix. (Only the last few dozen ids are decoded again: the text before them is kept
    once decoding it alone was checked to give the same text, so a long stream costs linear time.)
    Held back: a trailing incomplete character (U+FFFD of a multi-byte piece),
    trailing whitespace (a later piece may merge with it, or a tool call strip it), an end-of-turn
    token at the end (not part of the message if the model stops on it), a stop string or a tail that
    could begin one (the answer is trimmed there), and, when tool calls are parsed (``tool_format``),
    everything from where a call could begin, and all of a text that begins with whitespace (a call
    anywhere later strips it).
    """

    def __init__(self, chat: ChatTokenizer, sampling: dict[str, Any], tool_format: str | None) -> None:
        self.chat = chat
        self.skip_special = bool(sampling.get("skip_special_tokens", True))
        self.stops = [] if sampling.get("no_stop_trim") else list(sampling.get("stop") or [])
        self.tool_format = tool_format
        self.ids: list[int] = []
        self.sent = ""
        self._head_ids = 0  # ids[:_head_ids] decode to _head_text whatever follows them
        self._head_text = ""
        self._frozen = False  # the stable text once disagreed with what was sent: wait for the end

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        if self._frozen:
            return ""
        n = len(self.ids) - (1 if self.ids and self.ids[-1] in self.chat.eot_ids else 0)
        stable = self._stable(self._decoded(n))
        if not stable.startswith(self.sent):
            self._frozen = True
            return ""
        new, self.sent = stable[len(self.sent) :], stable
        return new

    def _decoded(self, n: int) -> str:
        """The text of ``ids[:n]``: the kept head, then the ids after it decoded again. The head moves on
        to ``n - _WINDOW`` once that many ids pile up after it, if decoding the two parts apart gives the
        text of decoding them together."""
        ids, head = self.ids, self._head_ids
        if n - head >= 2 * _WINDOW:
            cut = n - _WINDOW
            part = self._decode(ids[head:cut])
            if not part.endswith("\ufffd") and part + self._decode(ids[cut:n]) == self._decode(ids[head:n]):
                self._head_ids, self._head_text = cut, self._head_text + part
        return self._head_text + self._decode(ids[self._head_ids : n])

    def _decode(self, ids: list[int]) -> str:
        return self.chat.tok.decode(ids, skip_special_tokens=self.skip_special)

    def rest(self, final: str) -> str:
        """What is left to send of the finished content ``final``."""
        if final.startswith(self.sent):
            return final[len(self.sent) :]
        log.warning("streamed text %r is not a prefix of the final content %r", self.sent, final)
        return ""

    def _stable(self, text: str) -> str:
        text = text.rstrip("\ufffd")
        cut = len(text)
        for stop in self.stops:
            at = text.find(stop)
            cut = min(cut, at if at >= 0 else len(text) - _partial_tail(text, stop))
        if self.tool_format == "hermes":
            if not text[:1].strip():
                return ""
            at = text.find(_TOOL_OPEN)
            cut = min(cut, at if at >= 0 else len(text) - _partial_tail(text, _TOOL_OPEN))
        elif self.tool_format is not None:  # llama3: a call is the whole message, a JSON object
            head = text.lstrip()
            if not head or head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head):
                return ""
        return text[:cut].rstrip()


class Generations:
    """The ``n`` generations of one streamed request, their tokens arriving on one queue as
    ``(choice index, ids)``, and ``(choice index, None)`` once that generation ended."""

    def __init__(self, start: Callable[[int, Callable[[list[int], list[float]], None]], Any], n: int) -> None:
        self.queue: asyncio.Queue[tuple[int, list[int] | None]] = asyncio.Queue()
        self.tasks: list[asyncio.Future] = []
        for i in range(n):
            task = asyncio.ensure_future(start(i, functools.partial(self._tokens, i)))
            task.add_done_callback(functools.partial(self._ended, i))
            self.tasks.append(task)

    def _tokens(self, i: int, ids: list[int], logprobs: list[float]) -> None:
        self.queue.put_nowait((i, list(ids)))

    def _ended(self, i: int, task: asyncio.Future) -> None:
        self.queue.put_nowait((i, None))

    async def first(self) -> tuple[int, list[int] | None]:
        """The first arrival; raises the :class:`OpenAIError` of a generation that failed before any token
        (the others cancelled)."""
        try:
            item = await self.queue.get()
        except BaseException:
            self.cancel()
            raise
        i, ids = item
        if ids is None and (err := self.error(i)) is not None:
            self.cancel()
            raise err
        return item

    def error(self, i: int) -> BaseException | None:
        """What generation ``i`` (ended) raised, if anything."""
        t = self.tasks[i]
        return asyncio.CancelledError() if t.cancelled() else t.exception()

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()


def error_event(err: BaseException) -> dict[str, Any]:
    if isinstance(err, OpenAIError):
        return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    log.error("streamed generation failed", exc_info=err)
    return {"error": {"message": f"{type(err).__name__}: {err}", "type": "server_error", "code": None}}


class Events:
    """A streamed answer's data items as they are produced; :meth:`aclose` (the client went away) also
    cancels its generations, whether or not anything was read."""

    def __init__(self, items: AsyncGenerator[Any, None], gens: Generations) -> None:
        self._items = items
        self._gens = gens

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> Any:
        return await self._items.__anext__()

    async def aclose(self) -> None:
        self._gens.cancel()
        await self._items.aclose()


def chat_events(
    gens: Generations,
    first: tuple[int, list[int] | None],
    head: dict[str, Any],
    texts: list[StableText],
    finish: Callable[[int, Any], dict[str, Any]],
    usage: Callable[[list[Any]], dict[str, Any] | None],
) -> Events:
    """The chunk sequence of a streamed chat completion (see the module docstring). ``finish(i, gen)``
    is the finished choice (``message``, ``logprobs``, ``finish_reason``) of generation ``i``; ``usage``
    the usage chunk's body for all of them, or None when it was not asked for."""
    return Events(_items(gens, first, texts, finish, usage, _ChatChunks(head)), gens)


def completion_events(
    gens: Generations,
    first: tuple[int, list[int] | None],
    head: dict[str, Any],
    texts: list[StableText],
    finish: Callable[[int, Any], dict[str, Any]],
    usage: Callable[[list[Any]], dict[str, Any] | None],
) -> Events:
    """The chunk sequence of a streamed text completion: text deltas, then per choice the rest of its
    text and its ``finish_reason`` with its ``logprobs``; usage; ``[DONE]``."""
    return Events(_items(gens, first, texts, finish, usage, _CompletionChunks(head)), gens)


class _ChatChunks:
    """Chat chunks: a role delta per choice first; a finished choice's rest of text, tool calls, finish."""

    def __init__(self, head: dict[str, Any]) -> None:
        self.head = {**head, "object": "chat.completion.chunk"}

    def _chunk(self, i: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {**self.head, "choices": [{"index": i, "delta": delta, "finish_reason": None, **extra}]}

    def opening(self, i: int) -> list[dict[str, Any]]:
        return [self._chunk(i, {"role": "assistant", "content": ""})]

    def delta(self, i: int, text: str) -> dict[str, Any]:
        return self._chunk(i, {"content": text})

    def closing(self, i: int, choice: dict[str, Any], text: StableText) -> list[dict[str, Any]]:
        msg = choice["message"]
        out = [self._chunk(i, {"content": rest})] if (rest := text.rest(msg.get("content") or "")) else []
        out += [
            self._chunk(i, {"tool_calls": [{"index": k, **c}]})
            for k, c in enumerate(msg.get("tool_calls") or [])
        ]
        out.append(self._chunk(i, {}, finish_reason=choice["finish_reason"], logprobs=choice["logprobs"]))
        return out


class _CompletionChunks:
    """Text-completion chunks: text deltas; a finished choice's rest of text with its logprobs and finish."""

    def __init__(self, head: dict[str, Any]) -> None:
        self.head = {**head, "object": "text_completion"}

    def _chunk(
        self, i: int, text: str, logprobs: Any = None, finish_reason: str | None = None
    ) -> dict[str, Any]:
        c = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self.head, "choices": [c]}

    def opening(self, i: int) -> list[dict[str, Any]]:
        return []

    def delta(self, i: int, text: str) -> dict[str, Any]:
        return self._chunk(i, text)

    def closing(self, i: int, choice: dict[str, Any], text: StableText) -> list[dict[str, Any]]:
        return [self._chunk(i, text.rest(choice["text"]), choice["logprobs"], choice["finish_reason"])]


async def _items(
    gens: Generations,
    first: tuple[int, list[int] | None],
    texts: list[StableText],
    finish: Callable[[int, Any], dict[str, Any]],
    usage: Callable[[list[Any]], dict[str, Any] | None],
    fmt: _ChatChunks | _CompletionChunks,
) -> AsyncGenerator[Any, None]:
    """Either endpoint's stream in ``fmt``'s chunks: openings, then deltas as tokens arrive and each
    choice's closing chunks as it ends (an engine error ends the stream with an error event); usage;
    ``[DONE]``."""
    done: list[Any] = [None] * len(texts)
    try:
        for i in range(len(texts)):
            for c in fmt.opening(i):
                yield c
        async for i, ids in _arrivals(gens, first, len(texts)):
            if ids is not None:
                if new := texts[i].push(ids):
                    yield fmt.delta(i, new)
                continue
            if (err := gens.error(i)) is not None:
                yield error_event(err)
                return
            done[i] = gens.tasks[i].result()
            for c in fmt.closing(i, finish(i, done[i]), texts[i]):
                yield c
        if (body := usage(done)) is not None:
            yield {**fmt.head, "choices": [], "usage": body}
        yield "[DONE]"
    finally:
        gens.cancel()


async def _arrivals(
    gens: Generations, first: tuple[int, list[int] | None], n: int
) -> AsyncIterator[tuple[int, list[int] | None]]:
    """``first``, then the queue's items until all ``n`` generations ended."""
    item, left = first, n
    while True:
        yield item
        if item[1] is None:
            left -= 1
            if left == 0:
                return
        item = await gens.queue.get()


__all__ = ["Events", "Generations", "StableText", "chat_events", "completion_events", "error_event"]
