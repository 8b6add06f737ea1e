"""Tools: typed async callables with JSON schemas, tool-call parsers, and the built-in search and python tools."""

from .base import Tool, ToolCall, ToolResult, ToolSet, call_record, parse_docstring, to_text, tool, truncate
from .parsers import HermesParser, ParseResult, SearchR1Action, parse_search_r1
from .python import python_tool
from .search import RetrievalClient, RetrievalError, format_docs, search_tool

__all__ = [
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
    "parse_docstring",
    "parse_search_r1",
    "python_tool",
    "search_tool",
    "to_text",
    "tool",
    "truncate",
]
