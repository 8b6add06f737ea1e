"""Tools: typed async callables with JSON schemas, tool-call parsers, the built-in search and python tools,
and the tool registry that lets a config name them (``env.kwargs.tools: [python, search]``)."""

from .base import (
    DEFAULT_TIMEOUT,
    Tool,
    ToolCall,
    ToolResult,
    ToolSet,
    call_record,
    parse_docstring,
    to_text,
    tool,
    tool_thread_counts,
    truncate,
)
from .parsers import HermesParser, ParseResult, SearchR1Action, parse_search_r1
from .python import python_tool
from .registry import TOOLS, list_tools, make_tool, register_tool, resolve_tools
from .search import RetrievalClient, RetrievalError, format_docs, search_tool

__all__ = [
    "DEFAULT_TIMEOUT",
    "TOOLS",
    "HermesParser",
    "ParseResult",
    "RetrievalClient",
    "RetrievalError",
    "SearchR1Action",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolSet",
    "call_record",
    "format_docs",
    "list_tools",
    "make_tool",
    "parse_docstring",
    "parse_search_r1",
    "python_tool",
    "register_tool",
    "resolve_tools",
    "search_tool",
    "to_text",
    "tool",
    "tool_thread_counts",
    "truncate",
]
