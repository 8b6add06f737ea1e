"""The recording proxy: an OpenAI-compatible endpoint per agent episode that records token-exact
trajectories while it forwards generation to the engines (embedded, SGLang, or an sglang-router).

One :class:`AgentProxy` (an aiohttp server on loopback, on the orchestrator's event loop) serves every
episode; each episode is an :class:`AgentSession` with its own base URL,
``http://127.0.0.1:PORT/s/<session id>/v1``, so concurrent episodes never mix. A call to a session that
has ended is answered 410, an unknown one 404. The openai client the rollout hands an agent reaches the
same endpoints in process (:class:`InProcessTransport`: no socket, no second HTTP request to parse);
any other HTTP client pointed at the base URL goes through the server and gets the same answers.

The proxy owns tokenization (:mod:`agentrl.engine.openai_api` renders the chat template and parses tool
calls) and generates with :class:`~agentrl.rollout.episode.EpisodeRunner`'s token-in/token-out turn, so a
call survives weight updates (it waits, resubmits the tokens sampled so far, mixes versions) exactly as
an Env episode does. It records, per call, the prompt ids sent and the output ids + logprobs + versions
received. A session's calls form *branches* (:class:`Branch`: one Trajectory each):

* A call whose messages are a branch's messages plus new ones (the assistant reply being the one this
  proxy returned, content and tool calls) continues that branch: the new messages' template delta is
  tokenized on its own (loss_mask 0) after the *sampled* ids of the reply, never a re-rendering of
  them. When the full re-rendering of the messages differs from those ids, that is counted
  (``agent_rerender_drift``) but nothing re-rendered is sent or trained on.
* Otherwise a call whose rendered prompt ids start with a branch's ids continues it (the new ids after
  them, loss_mask 0): the completions API, or an agent that rebuilt its messages token-identically.
* Otherwise it starts a new branch. If its prompt starts with an existing branch's prompt but not with
  that branch's prompt + completion, the model's own words were re-rendered differently or edited
  (tokenization drift): counted as ``agent_drift_splits``; an unrelated conversation (a sub-agent) as
  ``agent_new_conversations``.

The episode's rows are the branches no later call continued (its leaves); they share its one reward.

Sampling: in training ``temperature``, ``top_p`` and ``top_k`` are the run's (``rollout.sampling``; in
evaluation ``rollout.eval_sampling``), whatever the agent asks, so the rollout policy is the one the
trainer corrects for; the agent's ``max_tokens`` (within ``rollout.sampling.max_new_tokens``) and
``stop`` are honoured. ``rollout.max_turns`` bounds the calls per episode and
``rollout.max_total_tokens`` (``token_limit``) a branch's length.
"""

from __future__ import annotations

import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiohttp import web

from agentrl.chat import _MARK, ChatTokenizer
from agentrl.engine.client import EngineError, EngineRequestError
from agentrl.engine.openai_api import (
    Answer,
    Frontend,
    Generation,
    OpenAIError,
    Prompt,
    TokenHook,
    error_answer,
    error_response,
    respond,
)
from agentrl.engine.types import SamplingParams
from agentrl.rollout.dataset import Draw
from agentrl.rollout.episode import EpisodeRunner, Restart
from agentrl.rollout.metrics import RolloutMetrics
from agentrl.types import ToolCallRecord, Trajectory

log = logging.getLogger(__name__)

POLICY_MODEL = "policy"  # the model name an agent may always use (besides the served model's path)


def _canon(message: dict[str, Any]) -> str:
    """A message as compared between calls: role, text, tool calls (name + parsed arguments)."""
    calls = [
        (c["function"]["name"], _args(c["function"].get("arguments")))
        for c in message.get("tool_calls") or []
    ]
    key = [
        message["role"],
        message.get("content") or "",
        calls,
        message.get("tool_call_id"),
        message.get("name"),
    ]
    return json.dumps(key, sort_keys=True, ensure_ascii=False)


def record_tool_calls(traj: Trajectory, message: dict[str, Any]) -> None:
    """The tool calls of the assistant reply ``message`` (OpenAI ``tool_calls``), on the trajectory's last
    turn (the reply's): what the agent asked its tools for. Their results come with its next call."""
    calls = message.get("tool_calls") or []
    if calls and traj.turns:
        traj.turns[-1].tool_calls = [
            ToolCallRecord(c["function"]["name"], _args(c["function"].get("arguments")) or {}, id=c.get("id"))
            for c in calls
        ]


def record_tool_results(traj: Trajectory, messages: list[dict[str, Any]]) -> None:
    """Each ``tool`` message of a later call, as the result of the recorded call with its ``tool_call_id``
    (a call already answered keeps its first result)."""
    open_calls = {c.id: c for t in traj.turns for c in t.tool_calls if c.id is not None and c.result is None}
    for m in messages:
        call = open_calls.pop(m.get("tool_call_id"), None) if m.get("role") == "tool" else None
        if call is not None:
            content = m.get("content")
            call.result = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def _args(a: Any) -> Any:
    if isinstance(a, str):
        try:
            return json.loads(a)
        except json.JSONDecodeError:
            return a
    return a


@dataclass(eq=False)
class Branch:
    """One trajectory of an episode and the conversation state it ends in."""

    traj: Trajectory
    messages: list[str] | None = None  # canonical messages incl. the last reply (None: text completions)
    tools: str = "null"
    continued: bool = False  # a later call extended it: not a leaf
    last_eot: bool = False  # its last sampled token ends the assistant turn

    @property
    def ids(self) -> list[int]:
        return self.traj.prompt_ids + self.traj.response_ids


@dataclass(eq=False)
class _Pending:
    branch: Branch
    parent: Branch | None


@dataclass(eq=False)
class AgentSession:
    """One episode's endpoint state (a :class:`~agentrl.engine.openai_api.CompletionBackend`)."""

    sid: str
    proxy: AgentProxy
    draw: Draw
    sample_index: int
    sampling: SamplingParams
    m: RolloutMetrics
    train: bool
    branches: list[Branch] = field(default_factory=list)
    calls: int = 0
    closed: bool = False
    restart: str | None = None  # set when the episode must be re-run (too stale, interrupted)
    engine_error: str | None = None
    truncated: bool = False
    on_restart: Any = None  # callback: cancel the agent

    # ---- CompletionBackend ----------------------------------------------------------------------
    @property
    def model(self) -> str:
        return self.proxy.model

    @property
    def chat(self) -> ChatTokenizer:
        return self.proxy.chat

    @property
    def context_len(self) -> int:
        return self.proxy.episodes.cfg.token_limit

    def accepts_model(self, name: str) -> bool:
        return name in (POLICY_MODEL, self.proxy.model)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Prompt:
        # rendered and encoded once per call; _delta reuses the text instead of a second full render
        text = self.chat._render(messages, add_generation_prompt=True, tools=tools)
        return Prompt(self.chat.encode(text), messages, tools, text)

    async def generate(
        self,
        prompt: Prompt,
        sampling: dict[str, Any],
        rid: str,
        top_logprobs: int,
        on_tokens: TokenHook | None = None,
    ) -> Generation:
        # on_tokens is never called: a call is one token-in/token-out turn, so a streamed answer goes out
        # whole when the turn ends
        if self.closed:
            raise OpenAIError("this episode has ended", code="episode_ended", status=410)
        if top_logprobs:
            raise OpenAIError("top_logprobs is not available through the rollout proxy", "top_logprobs")
        cfg = self.proxy.episodes.cfg
        self.calls += 1
        if self.calls > cfg.max_turns:
            self.truncated = True
            raise OpenAIError(
                f"the episode made more than rollout.max_turns = {cfg.max_turns} model calls",
                code="max_turns_exceeded",
                status=429,
                type="rate_limit_error",
            )
        parent, traj, canon = self._place(prompt)
        branch = Branch(traj, messages=canon, tools=json.dumps(prompt.tools, sort_keys=True))
        room = cfg.token_limit - len(traj.prompt_ids) - len(traj.response_ids)
        if room <= 0:
            self.truncated = True
            raise OpenAIError(
                f"the episode's context is full (rollout token limit {cfg.token_limit})",
                "messages",
                "context_length_exceeded",
            )
        sp = self.sampling.model_copy(
            update={"max_new_tokens": min(self.sampling.max_new_tokens, int(sampling["max_new_tokens"]))}
        )
        stop = [*self.sampling.stop, *sampling.get("stop", [])]
        try:
            ids, lps, vers = await self.proxy.episodes._generate_turn(
                self.draw, traj, sp, stop, room, self.m, self.train
            )
        except Restart as why:
            self.restart = str(why.args[0]) if why.args else "restart"
            if self.on_restart is not None:
                self.on_restart()
            raise OpenAIError("the episode is being restarted", status=503, type="server_error") from None
        except EngineRequestError as err:
            raise OpenAIError(str(err)) from None
        except EngineError as err:
            self.engine_error = f"{type(err).__name__}: {err}"
            raise OpenAIError(str(err), status=502, type="server_error") from None
        text = self.chat.action_text(ids)
        traj.append_model_tokens(ids, lps, vers, text)
        self.m.turn(len(ids))
        finish, matched = "stop", None
        if ids and ids[-1] in self.chat.eot_ids:
            branch.last_eot = True
        elif len(ids) >= min(sp.max_new_tokens, room):
            finish = "length"
        else:
            matched = next((s for s in stop if text.endswith(s)), None)
        if parent is not None:
            parent.continued = True
        self.branches.append(branch)
        return Generation(
            ids,
            lps,
            finish,
            len(traj.prompt_ids) + len(traj.response_ids) - len(ids),
            weight_version=str(vers[-1]) if vers else None,
            matched_stop=matched,
            handle=_Pending(branch, parent),
        )

    def on_reply(self, gen: Generation, message: dict[str, Any] | None) -> None:
        pending: _Pending = gen.handle
        b = pending.branch
        if message is not None:
            record_tool_calls(b.traj, message)
        if message is None or b.messages is None:
            return
        b.messages.append(_canon({"role": "assistant", **message}))

    # ---- branches -------------------------------------------------------------------------------
    def _place(self, prompt: Prompt) -> tuple[Branch | None, Trajectory, list[str] | None]:
        """The branch this call continues (None: a new one), the working trajectory with the call's new
        tokens appended (loss_mask 0), and the call's canonical messages."""
        canon = [_canon(m) for m in prompt.messages] if prompt.messages is not None else None
        tools = json.dumps(prompt.tools, sort_keys=True)
        parent, delta = None, None
        if canon is not None:
            for b in sorted(self.branches, key=lambda b: -len(b.messages or [])):
                k = len(b.messages or [])
                if b.messages and b.tools == tools and len(canon) > k and canon[:k] == b.messages:
                    delta = self._delta(prompt, k, b)
                    if delta is not None:
                        parent = b
                        if b.ids + delta != prompt.ids:
                            self.m.count("agent_rerender_drift")
                        break
        if parent is None:
            best = None
            for b in self.branches:
                n = len(b.ids)
                if len(prompt.ids) >= n and prompt.ids[:n] == b.ids and (best is None or n > len(best.ids)):
                    best = b
            if best is not None:
                parent, delta = best, prompt.ids[len(best.ids) :]
        if parent is None:
            if self.branches:
                drift = any(prompt.ids[: len(b.traj.prompt_ids)] == b.traj.prompt_ids for b in self.branches)
                self.m.count("agent_drift_splits" if drift else "agent_new_conversations")
            traj = Trajectory(
                task_id=self.draw.task_id,
                group_id=self.draw.uid,
                prompt_ids=list(prompt.ids),
                sample_index=self.sample_index,
                label=self.draw.task.get("label"),
            )
        else:
            src = parent.traj
            traj = Trajectory(
                task_id=src.task_id,
                group_id=src.group_id,
                prompt_ids=list(src.prompt_ids),
                response_ids=list(src.response_ids),
                loss_mask=list(src.loss_mask),
                rollout_logprobs=list(src.rollout_logprobs),
                policy_versions=list(src.policy_versions),
                turns=list(src.turns),
                sample_index=src.sample_index,
                label=src.label,
            )
            if delta:
                traj.append_observation_tokens(list(delta), self._observation_text(prompt, parent, delta))
                self.m.observation(len(delta))
            record_tool_results(traj, prompt.messages or [])
        return parent, traj, canon

    def _observation_text(self, prompt: Prompt, parent: Branch, delta: list[int]) -> str:
        """What the observation turn shows in dumps and the viewer: the contents of the messages this call
        added after the branch's last reply, else (text completions) the delta's text."""
        if prompt.messages is not None and parent.messages is not None:
            added = prompt.messages[len(parent.messages) :]
            parts = [m.get("content") for m in added if m.get("role") != "assistant"]
            return "\n".join(
                p if isinstance(p, str) else json.dumps(p, ensure_ascii=False) for p in parts if p
            )
        return self.chat.tok.decode(delta, skip_special_tokens=False)

    def _delta(self, prompt: Prompt, k: int, b: Branch) -> list[int] | None:
        """Token ids of messages[k:] after the assistant reply messages[k-1] (the template's text from
        right after that reply's content to the next generation prompt), or None when the template does
        not render them as an append-only tail."""
        msgs = list(prompt.messages or [])
        if msgs[k - 1]["role"] != "assistant":
            return None
        marked = [*msgs[: k - 1], {"role": "assistant", "content": _MARK}, *msgs[k:]]
        chat = self.chat
        try:
            text = chat._render(marked, add_generation_prompt=True, tools=prompt.tools)
            full = prompt.text or chat._render(msgs, add_generation_prompt=True, tools=prompt.tools)
        except Exception:
            return None
        pos = text.rfind(_MARK)
        if pos < 0:
            return None
        tail = text[pos + len(_MARK) :]
        if not full.endswith(tail):
            return None
        ids = chat.encode(tail)
        # the reply's end-of-turn token is already in the sampled ids when the model stopped on it
        if b.last_eot and ids and ids[0] == chat._eot_in_tail:
            ids = ids[1:]
        return ids

    # ---- the episode's rows ---------------------------------------------------------------------
    def leaves(self) -> list[Trajectory]:
        """The trajectories no later call continued, the most recently extended first."""
        return [b.traj for b in reversed(self.branches) if not b.continued]


_ROUTES = {
    "chat/completions": ("POST", "chat"),
    "completions": ("POST", "completions"),
    "models": ("GET", "models"),
}


class AgentProxy:
    """The endpoints behind every episode's base URL (see the module docstring): an aiohttp server for
    any HTTP client, and :meth:`transport` for the openai clients the rollout hands to agents, which
    reach the same endpoints in process (no socket, no second HTTP parse)."""

    def __init__(self, episodes: EpisodeRunner, model: str = POLICY_MODEL, host: str = "127.0.0.1") -> None:
        self.episodes = episodes
        self.chat = episodes.chat
        self.model = model
        self.host = host
        self.sessions: dict[str, AgentSession] = {}
        self._ended: dict[str, None] = {}  # recently ended ids (answered 410, not 404)
        self.front = Frontend()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        if self._runner is not None:
            return

        async def handle(request: web.Request) -> web.StreamResponse:
            route = _ROUTES[request.match_info["route"]][1]
            raw = b"" if route == "models" else await request.read()
            sid = request.match_info["sid"]
            return await respond(request, await self.front.answer(route, lambda: self.session(sid), raw))

        app = web.Application(client_max_size=64 * 1024**2)
        app.add_routes(
            [web.route(m, f"/s/{{sid}}/v1/{{route:{r}}}", handle) for r, (m, _) in _ROUTES.items()]
        )
        # handler_cancellation: an agent that disconnects cancels its call, and with it the engine request
        runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self.host, 0))
        await web.SockSite(runner, sock).start()
        self._runner = runner
        self.url = f"http://{self.host}:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def transport(self) -> InProcessTransport:
        """An ``httpx`` transport that answers this proxy's URLs in process."""
        return InProcessTransport(self)

    def session(self, sid: str) -> AgentSession:
        s = self.sessions.get(sid)
        if s is None:
            if sid in self._ended:
                raise OpenAIError("this episode has ended", code="episode_ended", status=410)
            raise OpenAIError(f"no episode {sid!r} on this proxy", code="unknown_episode", status=404)
        return s

    def open(
        self, draw: Draw, i: int, sampling: SamplingParams, m: RolloutMetrics, train: bool
    ) -> AgentSession:
        sid = uuid.uuid4().hex
        s = AgentSession(sid, self, draw, i, sampling, m, train)
        self.sessions[sid] = s
        return s

    def base_url(self, session: AgentSession) -> str:
        return f"{self.url}/s/{session.sid}/v1"

    def close(self, session: AgentSession) -> None:
        session.closed = True
        self.sessions.pop(session.sid, None)
        self._ended[session.sid] = None
        while len(self._ended) > 10_000:
            self._ended.pop(next(iter(self._ended)))


class InProcessTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport that answers ``/s/<sid>/v1/...`` of one :class:`AgentProxy` by calling its
    endpoints directly, without a socket: the same answers, status codes and streams as over HTTP.
    Cancelling the caller cancels the call (and its engine request), as a disconnect does over HTTP."""

    def __init__(self, proxy: AgentProxy) -> None:
        self.proxy = proxy

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.split("/", 4)  # '', 's', sid, 'v1', route
        method, route = _ROUTES.get(parts[4] if len(parts) == 5 else "", (None, None))
        if parts[:2] != ["", "s"] or parts[3:4] != ["v1"] or route is None:
            ans = error_answer(OpenAIError(f"no route {request.url.path}", status=404))
        elif request.method != method:
            ans = error_answer(OpenAIError(f"{request.method} is not allowed here", status=405))
        else:
            raw = await request.aread()
            ans = await self.proxy.front.answer(route, lambda: self.proxy.session(parts[2]), raw)
        headers = {"content-type": ans.content_type}
        if ans.events is None:
            return httpx.Response(ans.status, headers=headers, content=ans.payload())
        return httpx.Response(ans.status, headers=headers, stream=_AnswerStream(ans))


class _AnswerStream(httpx.AsyncByteStream):
    """A streamed answer's server-sent events as an ``httpx`` response body, read as they are produced;
    closing it early (the agent stopped reading) cancels the call."""

    def __init__(self, ans: Answer) -> None:
        self.ans = ans

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for data in self.ans.chunks():
            yield data

    async def aclose(self) -> None:
        await self.ans.aclose()


__all__ = ["POLICY_MODEL", "AgentProxy", "AgentSession", "Branch", "InProcessTransport", "error_response"]
