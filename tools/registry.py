"""The tool registry: tools named in a config (``env.kwargs.tools: [python, {search: {url: ...}}]``).

An entry is a :class:`~.base.Tool` (``@register_tool("convert")`` over ``@tool``) or a factory that returns
one (``@register_tool("calculator")`` over ``def calculator_tool(precision: int = 6) -> Tool``). Built-ins:
``python`` (:func:`python_from_config`: code run in the process-wide shared sandbox) and ``search``
(:func:`~.search.search_tool`: a retrieval server's ``/retrieve``). A ``"module:attr"`` name points at user
code without registering it; a plain typed function found there becomes a tool (:meth:`Tool.from_function`).

:func:`resolve_tools` turns a config's list into tools. Each item is one of:

* a name: ``python``, ``my_tools:convert``;
* a name with arguments: ``{python: {timeout: 5}}`` or ``{name: python, timeout: 5}``; a factory takes them
  as its keyword arguments, a ready tool takes the :class:`Tool` options (``timeout``, ``max_output_chars``,
  ``name``, ``description``);
* a :class:`Tool` or a typed function (from Python code).

:func:`check_tool_specs` checks only the names (what a config load does before anything starts); unknown
ones fail with the nearest known name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from agentrl.registry import Registry

from .base import DEFAULT_MAX_OUTPUT_CHARS, Tool

TOOLS: Registry[Any] = Registry("tool", builtins=lambda: _register_builtins())
TOOL_OPTIONS = ("name", "description", "timeout", "max_output_chars")  # what a ready tool can take


def register_tool(name: str, *, overwrite: bool = False) -> Callable[[Any], Any]:
    """Decorator: ``@register_tool("convert")`` over a :class:`Tool` or a factory returning one."""
    return TOOLS.register(name, overwrite=overwrite)


def list_tools() -> list[str]:
    return TOOLS.names()


def python_from_config(
    backend: str | None = None, timeout: float = 10.0, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS
) -> Tool:
    """The ``python`` tool on the process-wide shared sandbox of ``backend`` (docker | process | auto; the
    sandbox starts at the first call and is shared by every episode)."""
    from agentrl.tools.python import python_tool

    return python_tool(None, timeout, max_output_chars, backend=backend)


def _register_builtins() -> None:
    from .search import search_tool

    TOOLS.add("python", python_from_config)
    TOOLS.add("search", search_tool)


def _split(spec: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of a config item: ``"python"``, ``{python: {...}}`` or ``{name: python, ...}``."""
    if isinstance(spec, str):
        return spec, {}
    if "name" in spec:
        rest = {k: v for k, v in spec.items() if k != "name"}
        return str(spec["name"]), rest
    if len(spec) == 1:
        ((name, args),) = spec.items()
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ValueError(f"tool {name!r}: its arguments must be a mapping, got {args!r}")
        return str(name), dict(args)
    raise ValueError(
        f"a tool is a name, {{name: {{arguments}}}} or {{name: ..., argument: ...}}; got {spec!r}"
    )


def _is_factory(entry: Any) -> bool:
    """A callable that makes a tool (returns ``Tool``), as opposed to a plain function that is one."""
    if isinstance(entry, Tool) or isinstance(entry, type):
        return False
    try:
        returns = inspect.signature(entry).return_annotation
    except (TypeError, ValueError):
        return False
    return returns is Tool or returns in ("Tool", "agentrl.tools.Tool", "agentrl.tools.base.Tool")


def make_tool(spec: str | dict[str, Any]) -> Tool:
    """One tool from a config item (see the module docstring); unknown names raise KeyError."""
    name, args = _split(spec)
    entry = TOOLS.get(name)
    if _is_factory(entry):
        made = entry(**args)
        if not isinstance(made, Tool):
            raise TypeError(f"tool {name!r}: the factory returned {type(made).__name__}, not a Tool")
        return made
    unknown = sorted(set(args) - set(TOOL_OPTIONS))
    if unknown:
        raise TypeError(
            f"tool {name!r} is a tool, not a factory: it takes {list(TOOL_OPTIONS)}, not {unknown}"
        )
    if isinstance(entry, Tool):
        if not args:
            return entry
        options = {
            "name": entry.name,
            "description": entry.description,
            "timeout": entry.timeout,
            "max_output_chars": entry.max_output_chars,
            **args,
        }
        return Tool(entry.fn, **options)
    return Tool.from_function(entry, **args)


def resolve_tools(specs: Iterable[Tool | Callable[..., Any] | str | dict[str, Any]]) -> list[Tool]:
    """Tools from a list of config items, :class:`Tool` objects and typed functions, in order."""
    out = []
    for spec in specs:
        if isinstance(spec, str | dict):
            out.append(make_tool(spec))
        else:
            out.append(spec if isinstance(spec, Tool) else Tool.from_function(spec))
    return out


def check_tool_specs(specs: Any, field: str) -> None:
    """Raise ValueError naming ``field[i]`` for an item that names no known tool (the names only: nothing is
    built). Items that are not config items (tools from Python code) pass."""
    if isinstance(specs, str | dict):
        specs = [specs]
    if not isinstance(specs, list | tuple):
        return
    for i, spec in enumerate(specs):
        if not isinstance(spec, str | dict):
            continue
        try:
            name, _ = _split(spec)
            TOOLS.get(name)
        except (KeyError, ValueError) as err:
            raise ValueError(f"{field}[{i}]: {err.args[0]}") from None
