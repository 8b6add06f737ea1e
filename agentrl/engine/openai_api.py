"""OpenAI-compatible endpoints over token-in/token-out generation: ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models``, the way SGLang serves OpenAI's API.

The front end owns tokenization: it renders ``messages`` (and ``tools``) with the model's chat template,
asks a :class:`CompletionBackend` for tokens, detokenizes them and parses tool calls out of the text.
Two backends use it: the embedded engine (:func:`add_openai_routes` on the app of
:mod:`agentrl.embedded.server`, generation in process) and the rollout's recording proxy
(:mod:`agentrl.rollout.agent_proxy`, which forwards to ``/generate`` and records every token).

What is served: ``messages`` (text, or lists of text parts), ``tools`` / ``tool_choice``, ``n``,
``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``, ``logprobs``
and ``top_logprobs``, ``stream`` (server-sent events sent as the tokens arrive,
:mod:`agentrl.engine.openai_stream`, with ``stream_options.include_usage``), and
SGLang's extra sampling fields (``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``). Penalties, ``logit_bias`` and ``response_format`` are refused, not ignored.

Tool calls are parsed in the model family's format, chosen from its chat template: Hermes / Qwen
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (:class:`~agentrl.tools.parsers.HermesParser`),
or Llama 3's bare JSON object (optionally after ``<|python_tag|>``). A malformed call comes back as plain
``content`` with ``finish_reason`` ``stop``, never as an error.

Request checks, the error type and tool-call parsing live in :mod:`agentrl.engine.openai_request`
(they need no server); this module holds the front end, the answers and the routes.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for an unknown
model, ``messages`` that is not a non-empty list of messages, a bad tool schema or ``tool_choice``, a
prompt that does not fit the context, an unsupported parameter. A client that disconnects cancels its
handler, and the backend aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from agentrl.chat import ChatTokenizer
from agentrl.engine.openai_request import (
    OpenAIError,
    check_messages,
    check_tool_choice,
    check_tools,
    parse_tool_calls,
    sampling_params,
    tool_call_format,
)
from agentrl.engine.openai_stream import Events, Generations, StableText, chat_events, completion_events

TokenHook = Callable[[list[int], list[float]], None]

__all__ = [
    "Answer",
    "CompletionBackend",
    "Frontend",
    "Generation",
    "OpenAIError",
    "Prompt",
    "add_openai_routes",
    "error_answer",
    "error_response",
    "parse_tool_calls",
    "tool_call_format",
]


def error_response(err: OpenAIError) -> web.Response:
    return web.json_response(error_answer(err).body, status=err.status)


@dataclass
class Prompt:
    """What one completion continues: the rendered ids, and for chat the messages and tools they came from
    (a recording backend may continue an episode's exact ids instead of this rendering)."""

    ids: list[int]
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    text: str | None = None  # the rendered chat template the ids were encoded from


@dataclass
class Generation:
    """One completion from a backend: sampled ids and their logprobs (raw-model, as ``/generate``)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length | abort
    prompt_tokens: int
    cached_tokens: int = 0
    weight_version: str | None = None
    matched_stop: str | None = None  # the stop string that ended it (trimmed from the text)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    handle: Any = None  # the backend's own record of this generation (see CompletionBackend.on_reply)


class CompletionBackend(Protocol):
    """What the front end needs from whatever samples the tokens."""

    model: str  # the served model id (/v1/models)
    chat: ChatTokenizer
    context_len: int  # prompt + completion tokens at most

    def accepts_model(self, name: str) -> bool: ...

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Prompt:
        """The chat prompt for checked ``messages`` and ``tools`` (the template, with the generation
        prompt)."""
        ...

    async def generate(
        self,
        prompt: Prompt,
        sampling: dict[str, Any],
        rid: str,
        top_logprobs: int,
        on_tokens: TokenHook | None = None,
    ) -> Generation:
        """Sample one completion of ``prompt`` (SGLang ``sampling_params``); abort it in the engine if
        cancelled. ``on_tokens(ids, logprobs)``, when given, may be called with the tokens sampled since
        its last call while the completion runs (a backend that cannot stream calls it never). May raise
        :class:`OpenAIError`."""
        ...

    def on_reply(self, gen: Generation, message: dict[str, Any] | None) -> None:
        """The assistant message the client receives for ``gen`` (None for a text completion)."""
        ...


# ---- answers ------------------------------------------------------------------------------------------
def _finish(gen: Generation, calls: bool) -> str:
    if calls:
        return "tool_calls"
    return "length" if gen.finish_reason == "length" else "stop"


def _token_text(chat: ChatTokenizer, ids: list[int]) -> list[str]:
    tok = chat.tok
    return [tok.convert_tokens_to_string([t]) for t in tok.convert_ids_to_tokens(ids)]


def _chat_logprobs(chat: ChatTokenizer, gen: Generation) -> dict[str, Any]:
    words = _token_text(chat, gen.output_ids)
    content = []
    for k, (w, lp) in enumerate(zip(words, gen.logprobs, strict=True)):
        top = []
        if gen.top_logprobs is not None:
            alts = gen.top_logprobs[k]
            for alt_w, (_tid, alt_lp) in zip(_token_text(chat, [a[0] for a in alts]), alts, strict=True):
                top.append({"token": alt_w, "logprob": alt_lp, "bytes": list(alt_w.encode())})
        content.append({"token": w, "logprob": lp, "bytes": list(w.encode()), "top_logprobs": top})
    return {"content": content}


def _decode(chat: ChatTokenizer, gen: Generation, sp: dict[str, Any]) -> str:
    ids = gen.output_ids
    # the end-of-turn / EOS token the model stopped on is not part of the message
    if ids and gen.finish_reason == "stop" and ids[-1] in chat.eot_ids:
        ids = ids[:-1]
    text = chat.tok.decode(ids, skip_special_tokens=bool(sp.get("skip_special_tokens", True)))
    if gen.matched_stop and not sp.get("no_stop_trim"):
        cut = text.rfind(gen.matched_stop)
        if cut >= 0:
            text = text[:cut]
    return text


def _usage(gens: list[Generation]) -> dict[str, Any]:
    prompt = gens[0].prompt_tokens if gens else 0
    completion = sum(len(g.output_ids) for g in gens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": gens[0].cached_tokens if gens else 0},
    }


@dataclass
class Answer:
    """One answer, whatever carries it (HTTP, or an in-process transport): a JSON object, or with
    ``stream`` the data items of its server-sent events as they are produced (the last one ``"[DONE]"``;
    closing the iterator early cancels the generations behind it)."""

    status: int
    body: Any = None
    events: Events | None = None

    @property
    def content_type(self) -> str:
        return "application/json" if self.events is None else "text/event-stream"

    def payload(self) -> bytes:
        """The JSON body (not for a stream: read :meth:`chunks`)."""
        return json.dumps(self.body, ensure_ascii=False).encode()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The bytes to send: the payload, or one server-sent event per data item as it comes."""
        if self.events is None:
            yield self.payload()
            return
        async for e in self.events:
            yield event_bytes(e)

    async def aclose(self) -> None:
        """Done with this answer (sent, or the client went away): a stream's generations are cancelled."""
        if self.events is not None:
            await self.events.aclose()


def event_bytes(obj: Any) -> bytes:
    """One server-sent event: ``data: <JSON or the string>`` and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def error_answer(err: OpenAIError) -> Answer:
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    return Answer(err.status, body)


class Frontend:
    """The three endpoints over bytes in, :class:`Answer` out; :func:`openai_handlers` puts them on
    aiohttp routes and the rollout proxy also calls :meth:`answer` in process."""

    def __init__(self) -> None:
        self.fmt_cache: dict[int, str] = {}

    async def answer(self, route: str, resolve: Callable[[], CompletionBackend], raw: bytes) -> Answer:
        """``route`` is ``chat``, ``completions`` or ``models``; ``resolve`` finds the backend (it may
        raise :class:`OpenAIError`, e.g. 404 for an unknown episode); ``raw`` is the request body."""
        try:
            backend = resolve()
            if route == "models":
                return self.models(backend)
            body = _body(raw)
            _check_model(backend, body)
            if route == "chat":
                return await self.chat_completions(backend, body)
            return await self.completions(backend, body)
        except OpenAIError as err:
            return error_answer(err)

    async def _generate_n(
        self, backend: CompletionBackend, prompt: Prompt, sp: dict[str, Any], n: int, top: int
    ) -> list[Generation]:
        rid = uuid.uuid4().hex
        if n == 1:  # the common case: no gather, no extra task
            return [await backend.generate(prompt, sp, f"{rid}-0", top)]
        sps = _per_choice(sp, n)
        return list(
            await asyncio.gather(*(backend.generate(prompt, s, f"{rid}-{i}", top) for i, s in enumerate(sps)))
        )

    async def _stream(
        self,
        backend: CompletionBackend,
        prompt: Prompt,
        sp: dict[str, Any],
        n: int,
        top: int,
        tool_format: str | None,
    ) -> tuple[Generations, tuple[int, list[int] | None], list[StableText]]:
        """Start ``n`` generations that report their tokens, and wait for the first arrival (an
        :class:`OpenAIError` raised before any token is still answered as a plain error)."""
        rid, sps = uuid.uuid4().hex, _per_choice(sp, n)
        gens = Generations(
            lambda i, hook: backend.generate(prompt, sps[i], f"{rid}-{i}", top, on_tokens=hook), n
        )
        first = await gens.first()
        return gens, first, [StableText(backend.chat, s, tool_format) for s in sps]

    async def chat_completions(self, backend: CompletionBackend, body: dict[str, Any]) -> Answer:
        messages = check_messages(body.get("messages"))
        tools = check_tools(body.get("tools"))
        choice = check_tool_choice(body.get("tool_choice"), tools)
        n, top, want_lp = _n_and_logprobs(body)
        prompt = backend.render(messages, tools)
        sp = sampling_params(body, len(prompt.ids), backend.context_len)
        fmt = self.fmt_cache.get(id(backend.chat))
        if fmt is None:
            fmt = self.fmt_cache.setdefault(id(backend.chat), tool_call_format(backend.chat.tok))

        def finish(i: int, g: Generation) -> dict[str, Any]:
            text = _decode(backend.chat, g, sp)
            content, calls = parse_tool_calls(text, fmt) if choice != "none" else (text, [])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            backend.on_reply(g, message)
            return {
                "index": i,
                "message": message,
                "logprobs": _chat_logprobs(backend.chat, g) if want_lp else None,
                "finish_reason": _finish(g, bool(calls)),
                "matched_stop": g.matched_stop,
            }

        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": backend.model}
        if body.get("stream"):
            gens, first, texts = await self._stream(
                backend, prompt, sp, n, top, fmt if choice != "none" else None
            )
            head["system_fingerprint"] = None  # the weight version is known once a generation ends
            return Answer(200, events=chat_events(gens, first, head, texts, finish, _usage_if(body)))
        gens = await self._generate_n(backend, prompt, sp, n, top)
        choices = [finish(i, g) for i, g in enumerate(gens)]
        head["system_fingerprint"] = _fingerprint(gens)
        return Answer(200, {**head, "object": "chat.completion", "choices": choices, "usage": _usage(gens)})

    async def completions(self, backend: CompletionBackend, body: dict[str, Any]) -> Answer:
        raw = body.get("prompt")
        if isinstance(raw, str):
            ids = backend.chat.encode(raw)
        elif isinstance(raw, list) and raw and all(isinstance(i, int) for i in raw):
            ids = list(raw)
        else:
            raise OpenAIError(
                "prompt must be a string or a list of token ids (one prompt per request)", "prompt"
            )
        if not ids:
            raise OpenAIError("prompt is empty", "prompt")
        n, _, _ = _n_and_logprobs({k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")})
        lp = body.get("logprobs")
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= 20):
            raise OpenAIError("logprobs must be an integer from 0 to 20", "logprobs")
        sp = sampling_params(body, len(ids), backend.context_len)

        def finish(i: int, g: Generation) -> dict[str, Any]:
            backend.on_reply(g, None)
            text = _decode(
                backend.chat, g, {**sp, "skip_special_tokens": sp.get("skip_special_tokens", True)}
            )
            logprobs = None
            if lp is not None:
                words = _token_text(backend.chat, g.output_ids)
                offsets, pos = [], 0
                for w in words:
                    offsets.append(pos)
                    pos += len(w)
                logprobs = {
                    "tokens": words,
                    "token_logprobs": g.logprobs,
                    "top_logprobs": [
                        dict(
                            zip(
                                _token_text(backend.chat, [a[0] for a in alts]),
                                [a[1] for a in alts],
                                strict=True,
                            )
                        )
                        for alts in (g.top_logprobs or [[] for _ in words])
                    ]
                    if lp
                    else None,
                    "text_offset": offsets,
                }
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": _finish(g, False)}

        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": backend.model}
        if body.get("stream"):
            gens, first, texts = await self._stream(backend, Prompt(ids), sp, n, lp or 0, None)
            return Answer(200, events=completion_events(gens, first, head, texts, finish, _usage_if(body)))
        gens = await self._generate_n(backend, Prompt(ids), sp, n, lp or 0)
        choices = [finish(i, g) for i, g in enumerate(gens)]
        return Answer(200, {**head, "object": "text_completion", "choices": choices, "usage": _usage(gens)})

    def models(self, backend: CompletionBackend) -> Answer:
        card = {
            "id": backend.model,
            "object": "model",
            "created": 0,
            "owned_by": "agentrl",
            "root": backend.model,
        }
        return Answer(200, {"object": "list", "data": [card]})


def _check_model(backend: CompletionBackend, body: dict[str, Any]) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not backend.accepts_model(model):
        raise OpenAIError(
            f"The model {model!r} does not exist; this server serves {backend.model!r}",
            "model",
            "model_not_found",
        )


def _per_choice(sp: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The sampling of each of ``n`` choices: a seeded request's choice i draws with seed + i."""
    if "sampling_seed" not in sp:
        return [sp] * n
    return [{**sp, "sampling_seed": sp["sampling_seed"] + i} for i in range(n)]


def _usage_if(body: dict[str, Any]) -> Callable[[list[Generation]], dict[str, Any] | None]:
    """The usage of a stream's generations, when ``stream_options.include_usage`` asked for it."""
    want = bool((body.get("stream_options") or {}).get("include_usage"))
    return lambda gens: _usage(gens) if want else None


def _fingerprint(gens: list[Generation]) -> str | None:
    v = gens[0].weight_version if gens else None
    return None if v is None else f"weights-{v}"


def _n_and_logprobs(body: dict[str, Any]) -> tuple[int, int, bool]:
    n = body.get("n", 1) if body.get("n") is not None else 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
        raise OpenAIError("n must be an integer from 1 to 128", "n")
    want = bool(body.get("logprobs"))
    top = body.get("top_logprobs")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
            raise OpenAIError("top_logprobs must be an integer from 0 to 20", "top_logprobs")
        if top and not want:
            raise OpenAIError("top_logprobs requires logprobs: true", "top_logprobs")
    return n, int(top or 0), want


def _body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        raise OpenAIError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


# ---- routes -------------------------------------------------------------------------------------------
async def respond(request: web.Request, ans: Answer) -> web.StreamResponse:
    """Send an :class:`Answer` over aiohttp (a stream as server-sent events)."""
    if ans.events is None:
        return web.json_response(ans.body, status=ans.status)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:  # a client that disconnects cancels this handler; closing the answer cancels its generations
        await resp.prepare(request)
        async for data in ans.chunks():
            await resp.write(data)
        await resp.write_eof()
    finally:
        await ans.aclose()
    return resp


def openai_handlers(resolve: Callable[[web.Request], CompletionBackend]) -> dict[str, Callable]:
    """The three handlers for a backend found per request (the proxy: per episode session)."""
    front = Frontend()

    def route(name: str) -> Callable:
        async def handler(request: web.Request) -> web.StreamResponse:
            raw = b"" if name == "models" else await request.read()
            return await respond(request, await front.answer(name, lambda: resolve(request), raw))

        return handler

    return {name: route(name) for name in ("chat", "completions", "models")}


def add_openai_routes(app: web.Application, backend: CompletionBackend, prefix: str = "/v1") -> None:
    """Register ``{prefix}/chat/completions``, ``{prefix}/completions`` and ``{prefix}/models``."""
    h = openai_handlers(lambda request: backend)
    app.add_routes(
        [
            web.post(f"{prefix}/chat/completions", h["chat"]),
            web.post(f"{prefix}/completions", h["completions"]),
            web.get(f"{prefix}/models", h["models"]),
        ]
    )
