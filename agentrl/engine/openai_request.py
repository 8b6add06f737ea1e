"""What an OpenAI-style request may say, checked, and what the model's text says back: the pieces of
:mod:`agentrl.engine.openai_api` that need no server.

* :class:`OpenAIError`: an error answered in OpenAI's JSON shape.
* Request checks: ``messages``, ``tools``, ``tool_choice`` and the sampling fields (OpenAI's names, and
  SGLang's extra ones), mapped to SGLang's ``sampling_params``; what cannot be honoured is refused.
* Tool calls read out of the model's text in its family's format (:func:`tool_call_format`,
  :func:`parse_tool_calls`): a malformed call stays plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from agentrl.tools.parsers import HermesParser

__all__ = [
    "OpenAIError",
    "check_messages",
    "check_tool_choice",
    "check_tools",
    "parse_tool_calls",
    "sampling_params",
    "tool_call_format",
]

_ROLES = {"system", "developer", "user", "assistant", "tool"}
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# Sampling fields SGLang takes beside OpenAI's (sent by the openai SDK through ``extra_body``).
_EXTRA_SAMPLING = ("top_k", "min_p", "ignore_eos", "stop_token_ids", "skip_special_tokens", "no_stop_trim")
_REFUSED = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "response_format": None,
    "best_of": 1,
    "suffix": None,
    "echo": False,
}


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON shape (``status`` 400 unless said otherwise)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type


# ---- tool calls ---------------------------------------------------------------------------------------
def tool_call_format(tokenizer: Any) -> str:
    """``hermes`` (``<tool_call>`` JSON, Qwen / Hermes templates), ``llama3`` (bare JSON object) or
    ``hermes`` as the default when the template names neither."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template)
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


_HERMES = HermesParser()


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` in OpenAI's shape. A malformed call leaves the whole text as content and
    no calls: the client sees what the model wrote."""
    if fmt == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            return text, []
        args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return text, []
        return None, [_openai_call(obj["name"], args)]
    parsed = _HERMES.parse(text)
    if parsed.errors or not parsed.calls:
        return text, []
    return (parsed.content or None), [_openai_call(c.name, c.arguments) for c in parsed.calls]


def _openai_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


# ---- request validation -------------------------------------------------------------------------------
def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise OpenAIError("tools must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise OpenAIError(f'{where}: expected {{"type": "function", "function": {{...}}}}', where)
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise OpenAIError(f"{where}.function: missing or not an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise OpenAIError(
                f"{where}.function.name: must be 1-64 characters of a-z, A-Z, 0-9, _ or -, got {name!r}",
                f"{where}.function.name",
            )
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise OpenAIError(
                f"{where}.function.parameters: must be a JSON schema object with type 'object'",
                f"{where}.function.parameters",
            )
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise OpenAIError(
                f"{where}.function.description: must be a string", f"{where}.function.description"
            )
        out.append({"type": "function", "function": fn})
    return out or None


def check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str:
    """``none``, ``auto``, ``required``, or the name of the one function to call."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise OpenAIError("tool_choice 'required' needs tools", "tool_choice")
        return str(choice)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise OpenAIError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return str(name)
    raise OpenAIError("tool_choice must be 'none', 'auto', 'required' or a function object", "tool_choice")


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise OpenAIError(f"{where}.content[{j}]: only text parts are supported", f"{where}.content")
            parts.append(p["text"])
        return "".join(parts)
    raise OpenAIError(f"{where}.content: must be a string or a list of text parts", f"{where}.content")


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (text parts joined); 400 on anything else."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list of message objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise OpenAIError(f"{where}: must be an object with role one of {sorted(_ROLES)}", where)
        msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"]}
        content = _text(m.get("content"), where)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise OpenAIError(f"{where}.tool_calls: must be a list", f"{where}.tool_calls")
            msg["tool_calls"] = [_check_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        elif content is None:
            raise OpenAIError(f"{where}.content: missing", f"{where}.content")
        msg["content"] = content or ""
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _check_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise OpenAIError(f"{where}: expected {{'function': {{'name', 'arguments'}}}}", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise OpenAIError(f"{where}.function.arguments: not valid JSON", where) from None
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def sampling_params(body: dict[str, Any], prompt_len: int, context_len: int) -> dict[str, Any]:
    """SGLang ``sampling_params`` for the request; 400 when the prompt leaves no room or a knob is
    unsupported."""
    for key, neutral in _REFUSED.items():
        if body.get(key) not in (None, neutral):
            raise OpenAIError(f"{key} is not supported by this server", key, "unsupported_parameter")
    room = context_len - prompt_len
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise OpenAIError("max_tokens must be a positive integer", "max_tokens")
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise OpenAIError(
            f"This model's maximum context length is {context_len} tokens. However, you requested "
            f"{prompt_len + (max_tokens or 1)} tokens ({prompt_len} in the messages, {max_tokens or 1} in "
            "the completion). Please reduce the length of the messages or completion.",
            "messages" if max_tokens is None or room < 1 else "max_tokens",
            "context_length_exceeded",
        )
    sp: dict[str, Any] = {"max_new_tokens": max_tokens or room}
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            if not isinstance(body[key], int | float):
                raise OpenAIError(f"{key} must be a number", key)
            sp[key] = float(body[key])
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise OpenAIError("stop must be a string or a list of up to 16 strings", "stop")
        if stop:
            sp["stop"] = stop
    if body.get("seed") is not None:
        if not isinstance(body["seed"], int):
            raise OpenAIError("seed must be an integer", "seed")
        sp["sampling_seed"] = body["seed"]
    for key in _EXTRA_SAMPLING:
        if body.get(key) is not None:
            sp[key] = body[key]
    return sp
