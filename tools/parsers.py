"""Tool-call parsers: model text in, structured calls (or precise complaints) out. They never raise.

* :class:`HermesParser` -- Hermes / Qwen2.5 / Qwen3 native format, any number of calls per turn:
  ``<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>``. ``arguments`` may also be a
  JSON-encoded string (some models emit that) or be named ``parameters``.
* :func:`parse_search_r1` -- Search-R1 tags: the first ``<search>...</search>`` or ``<answer>...</answer>``
  in the text decides the action, exactly as the Search-R1 rollout does.

A malformed call (bad JSON, missing name, arguments that are not an object, an unterminated tag) becomes
an entry of ``ParseResult.errors`` whose text is shown to the model as an error observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal

from .base import ToolCall

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_SEARCH_R1 = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


@dataclass
class ParseResult:
    """Calls found in one model turn, the errors for malformed ones, and the text outside the calls."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""

    @property
    def has_calls(self) -> bool:
        return bool(self.calls or self.errors)


class HermesParser:
    """Parse ``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3 chat templates)."""

    def __init__(self, max_calls: int = 8, max_call_chars: int = 100_000) -> None:
        self.max_calls = max_calls
        self.max_call_chars = max_call_chars

    def parse(self, text: str) -> ParseResult:
        out = ParseResult()
        if not isinstance(text, str):
            out.errors.append(f"model output is {type(text).__name__}, not text")
            return out
        last_end = 0
        pieces: list[str] = []
        n = 0
        for m in _TOOL_CALL.finditer(text):
            pieces.append(text[last_end : m.start()])
            last_end = m.end()
            if n >= self.max_calls:
                out.errors.append(
                    f"too many tool calls in one turn; only the first {self.max_calls} were run"
                )
                break
            self._parse_one(m.group(1), n, out)
            n += 1
        rest = text[last_end:]
        open_at = rest.find("<tool_call>")
        if open_at != -1 and n < self.max_calls:
            # A call opened but never closed: the model hit a stop string or max tokens mid-call. Complete
            # JSON is accepted (only the closing tag is missing); anything else is reported.
            self._parse_one(rest[open_at + len("<tool_call>") :], n, out, unterminated=True)
            rest = rest[:open_at]
        pieces.append(rest)
        out.content = "".join(pieces).strip()
        return out

    def _parse_one(self, body: str, index: int, out: ParseResult, unterminated: bool = False) -> None:
        where = f"tool call #{index + 1}"
        body = body.strip()
        if len(body) > self.max_call_chars:
            out.errors.append(f"{where}: too long ({len(body)} characters)")
            return
        if body.startswith("```"):  # some models wrap the JSON in a code fence
            body = re.sub(r"^```(?:json)?\s*|\s*```$", "", body)
        try:
            obj = json.loads(body)
        except RecursionError:  # adversarially deep nesting
            out.errors.append(f"{where}: JSON nested too deeply")
            return
        except json.JSONDecodeError as err:
            hint = " (the </tool_call> tag is missing)" if unterminated else ""
            out.errors.append(
                f"{where}: invalid JSON{hint}: {err.msg} at position {err.pos}. Expected "
                '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>'
            )
            return
        if not isinstance(obj, dict):
            out.errors.append(
                f"{where}: expected a JSON object with name and arguments, got {type(obj).__name__}"
            )
            return
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            out.errors.append(f'{where}: missing "name" (a string)')
            return
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except RecursionError:
                out.errors.append(f"{where} ({name}): arguments nested too deeply")
                return
            except json.JSONDecodeError as err:
                out.errors.append(f"{where} ({name}): arguments string is not valid JSON: {err.msg}")
                return
        if args is None:
            args = {}
        if not isinstance(args, dict):
            out.errors.append(
                f'{where} ({name}): "arguments" must be a JSON object, got {type(args).__name__}'
            )
            return
        call_id = obj.get("id") if isinstance(obj.get("id"), str) else f"call_{index}"
        out.calls.append(ToolCall(name=name.strip(), arguments=args, id=call_id, raw=body))


@dataclass
class SearchR1Action:
    """The decisive action of a Search-R1 turn."""

    kind: Literal["search", "answer", "invalid"]
    content: str = ""


def parse_search_r1(text: str) -> SearchR1Action:
    """The first ``<search>``/``<answer>`` block decides; its content is stripped. Neither: invalid."""
    if not isinstance(text, str):
        return SearchR1Action("invalid")
    m = _SEARCH_R1.search(text)
    if m is None:
        return SearchR1Action("invalid")
    return SearchR1Action(m.group(1), m.group(2).strip())  # type: ignore[arg-type]
