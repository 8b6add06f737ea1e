"""The Tool contract: a typed async callable with an OpenAI-format JSON schema derived from its signature.

    @tool
    async def add(a: int, b: int = 0) -> int:
        '''Add two integers.

        Args:
            a: first addend
            b: second addend
        '''
        return a + b

``add.schema`` is ``{"type": "function", "function": {"name": "add", "description": "Add two integers.",
"parameters": {...}}}`` built by pydantic from the type hints and the docstring's ``Args:`` section
(Google style; ``:param x:`` Sphinx style works too). ``await add.invoke({"a": "x"})`` validates the
arguments first and never raises: bad arguments, exceptions and timeouts come back as a
:class:`ToolResult` with ``is_error=True`` and a message meant for the model. Outputs are cut to
``max_output_chars`` with a visible marker. An env reports a call it ran as ``call_record(call, result)``
(:class:`~agentrl.types.ToolCallRecord`).

Timeouts: every call has one, :data:`DEFAULT_TIMEOUT` (30 s) unless the tool sets its own
(``@tool(timeout=5)``; ``None``: no limit). An async tool is cancelled at its timeout. A plain (sync)
function runs in a thread of its own, and a thread cannot be stopped from outside: at the timeout the call
returns its error result at once, and the thread is *abandoned*, left to finish in the background with its
result dropped. :func:`tool_thread_counts` counts such threads (the rollout reports them as
``rollout/tool_threads_abandoned`` and ``rollout/tool_threads_abandoned_running``); a sync tool that can
hang should bound its own work, or be async, or run its work where it can be killed (a sandbox).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from agentrl.types import ToolCallRecord

DEFAULT_TIMEOUT = 30.0  # seconds a tool call may take unless the tool sets its own timeout
DEFAULT_MAX_OUTPUT_CHARS = 8000

_threads_lock = threading.Lock()
_abandoned = {"total": 0, "running": 0}  # sync tool threads left behind at their timeout


def tool_thread_counts() -> dict[str, int]:
    """Sync tool threads of this process abandoned at their timeout: ``abandoned`` since the start, and
    ``abandoned_running``, those still running now."""
    with _threads_lock:
        return {"abandoned": _abandoned["total"], "abandoned_running": _abandoned["running"]}


async def _in_own_thread(fn: Callable[..., Any], args: dict[str, Any], name: str) -> Any:
    """``fn(**args)`` in a new daemon thread, awaited. Cancelled (the tool's timeout), the call returns at
    once and the thread is counted as abandoned until it ends. A thread of its own rather than the loop's
    default executor: abandoned threads would otherwise fill that pool and stall every ``to_thread``."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    state = {"finished": False, "abandoned": False}  # read and written under _threads_lock

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def work() -> None:
        try:
            value, ok = fn(**args), True
        except BaseException as err:  # handed to the awaiting call, as to_thread does
            value, ok = err, False
        with _threads_lock:
            state["finished"] = True
            if state["abandoned"]:
                _abandoned["running"] -= 1
                return
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop has closed meanwhile
            pass

    threading.Thread(target=work, name=f"tool-{name}", daemon=True).start()
    try:
        return await future
    except asyncio.CancelledError:
        with _threads_lock:
            if not state["finished"]:
                state["abandoned"] = True
                _abandoned["total"] += 1
                _abandoned["running"] += 1
        raise


@dataclass
class ToolCall:
    """One parsed call: ``name`` and its ``arguments`` (a dict), plus the call id and raw text if known."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str | None = None
    raw: str = ""


@dataclass
class ToolResult:
    """What a call produced, as text for the model. ``is_error``: the call failed (the text says why)."""

    name: str
    content: str
    is_error: bool = False
    call_id: str | None = None
    duration: float = 0.0


def call_record(call: ToolCall, result: ToolResult) -> ToolCallRecord:
    """What an env reports of a call it ran (``StepResult.tool_calls``): the call, and its result or error."""
    return ToolCallRecord(
        name=call.name,
        arguments=dict(call.arguments),
        result=None if result.is_error else result.content,
        error=result.content if result.is_error else None,
        latency_s=result.duration,
        id=call.id,
    )


def truncate(text: str, max_chars: int) -> str:
    """Cut ``text`` to about ``max_chars``, keeping head and tail around a visible marker."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    marker = "\n[... {n} characters truncated ...]\n"
    room = max(max_chars - len(marker) - 8, 16)
    head, tail = (room * 2) // 3, room - (room * 2) // 3
    return text[:head] + marker.format(n=len(text) - head - tail) + text[len(text) - tail :]


def to_text(value: Any) -> str:
    """Render a tool's return value as observation text."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if hasattr(value, "as_text"):  # e.g. a sandbox ExecResult
        return value.as_text()
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?)\s*:\s*$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google- or Sphinx-style docstring."""
    if not doc:
        return "", {}
    doc = inspect.cleandoc(doc)
    params: dict[str, str] = {}
    desc_lines: list[str] = []
    section: str | None = None
    current: str | None = None
    param_indent: int | None = None
    for line in doc.splitlines():
        m = _SECTION.match(line)
        if m:
            section, current, param_indent = m.group(1).lower(), None, None
            continue
        sphinx = re.match(r"^\s*:param\s+(?:[^:]+\s)?(\w+)\s*:\s*(.*)$", line)
        if sphinx:
            current = sphinx.group(1)
            params[current] = sphinx.group(2).strip()
            section = "sphinx"
            continue
        if section in ("args", "arguments", "parameters"):
            indent = len(line) - len(line.lstrip())
            g = re.match(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if g and (param_indent is None or indent <= param_indent):
                param_indent = indent
                current = g.group(1).lstrip("*")
                params[current] = g.group(2).strip()
            elif current and line.strip():  # a continuation line of the current parameter
                params[current] = (params[current] + " " + line.strip()).strip()
            continue
        if section == "sphinx" and current and line.strip() and not line.lstrip().startswith(":"):
            params[current] = (params[current] + " " + line.strip()).strip()
            continue
        if section is None:
            desc_lines.append(line)
    description = "\n".join(desc_lines).strip()
    # Keep the first paragraph: the summary and its elaboration, not examples further down.
    description = description.split("\n\n")[0].replace("\n", " ").strip()
    return description, params


def _strip_titles(schema: Any) -> Any:
    """pydantic adds a "title" to every property; OpenAI-format schemas do not need them."""
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title" or not isinstance(v, str)}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


class Tool:
    """A named, typed async callable the model can call. Build with :func:`tool` or :meth:`from_function`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"a tool needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", None) or type(fn).__name__
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.name):
            raise ValueError(
                f"tool name {self.name!r} must match [A-Za-z0-9_-]{{1,64}} (OpenAI function names)"
            )
        doc_desc, param_docs = parse_docstring(inspect.getdoc(fn))
        self.description = description if description is not None else doc_desc
        self.timeout = timeout
        self.max_output_chars = max_output_chars
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        self.args_model = self._build_model(fn, param_docs)
        functools.update_wrapper(self, fn, updated=())

    @classmethod
    def from_function(cls, fn: Callable[..., Any], **kwargs: Any) -> Tool:
        """Wrap ``fn`` (async preferred; a sync function runs in a thread). kwargs: see ``__init__``."""
        return cls(fn, **kwargs)

    def _build_model(self, fn: Callable[..., Any], param_docs: dict[str, str]) -> type[BaseModel]:
        sig = inspect.signature(fn)
        try:
            hints = get_type_hints(fn)
        except Exception:
            hints = getattr(fn, "__annotations__", {})
        fields: dict[str, Any] = {}
        for pname, p in sig.parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"tool {self.name}: *args/**kwargs cannot be described by a schema ({pname})")
            if p.kind is p.POSITIONAL_ONLY:
                raise TypeError(
                    f"tool {self.name}: positional-only parameter {pname} cannot be passed by name"
                )
            ann = hints.get(pname, Any)
            default = ... if p.default is p.empty else p.default
            fields[pname] = (ann, Field(default, description=param_docs.get(pname)))
        model_name = "".join(part.capitalize() for part in re.split(r"[_-]", self.name)) + "Args"
        return create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)

    @property
    def parameters(self) -> dict[str, Any]:
        schema = _strip_titles(self.args_model.model_json_schema())
        schema.pop("additionalProperties", None)
        schema.setdefault("properties", {})
        schema["type"] = "object"
        return schema

    @property
    def schema(self) -> dict[str, Any]:
        """OpenAI function-calling format (what chat templates take as ``tools=[...]``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Validated keyword arguments (raises pydantic.ValidationError)."""
        model = self.args_model.model_validate(arguments)
        return {k: getattr(model, k) for k in self.args_model.model_fields}

    async def __call__(self, **kwargs: Any) -> Any:
        """Direct call with validation (raises on error; the episode path uses :meth:`invoke`)."""
        args = self.validate(kwargs)
        if self.is_async:
            return await self.fn(**args)
        return await _in_own_thread(self.fn, args, self.name)

    async def invoke(self, arguments: dict[str, Any] | str | None, call_id: str | None = None) -> ToolResult:
        """Validate, run with the timeout, render and truncate. Never raises (except on cancellation)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        def result(text: str, is_error: bool) -> ToolResult:
            return ToolResult(
                self.name, truncate(text, self.max_output_chars), is_error, call_id, loop.time() - t0
            )

        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (json.JSONDecodeError, RecursionError) as err:
                return result(f"Error: arguments of {self.name} are not valid JSON: {err}", True)
        if not isinstance(arguments, dict):
            return result(
                f"Error: arguments of {self.name} must be a JSON object, got {type(arguments).__name__}", True
            )
        try:
            args = self.validate(arguments)
        except ValidationError as err:
            return result(f"Error: invalid arguments for {self.name}: {_validation_text(err)}", True)
        try:
            call: Awaitable[Any] = (
                self.fn(**args) if self.is_async else _in_own_thread(self.fn, args, self.name)
            )
            value = await asyncio.wait_for(call, self.timeout) if self.timeout else await call
        except TimeoutError:
            return result(f"Error: {self.name} timed out after {self.timeout:g}s", True)
        except Exception as err:
            return result(f"Error: {self.name} failed: {type(err).__name__}: {err}", True)
        return result(to_text(value), False)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


def _validation_text(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "<arguments>"
        msg = "unexpected argument" if e["type"] == "extra_forbidden" else e["msg"]
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> Any:
    """Decorator: ``@tool`` or ``@tool(name=..., timeout=...)`` turns a typed function into a
    :class:`Tool`."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(f, name=name, description=description, timeout=timeout, max_output_chars=max_output_chars)

    return wrap(fn) if fn is not None else wrap


class ToolSet:
    """Tools by name; runs parsed calls concurrently and turns every failure into an error result."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            t = t if isinstance(t, Tool) else Tool.from_function(t)
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def __len__(self) -> int:
        return len(self.tools)

    async def execute(self, call: ToolCall) -> ToolResult:
        t = self.tools.get(call.name)
        if t is None:
            known = ", ".join(sorted(self.tools)) or "(none)"
            return ToolResult(
                call.name, f"Error: unknown tool {call.name!r}; available tools: {known}", True, call.id
            )
        return await t.invoke(call.arguments, call.id)

    async def execute_all(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Results in call order; calls run concurrently."""
        return list(await asyncio.gather(*(self.execute(c) for c in calls)))
