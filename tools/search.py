"""The ``search`` tool: an HTTP client of a Search-R1-compatible retrieval server.

Protocol: ``POST {url}/retrieve`` with ``{"queries": [str], "topk": int, "return_scores": true}``, answered
by ``{"result": [[{"document": {"id", "contents": "\\"Title\\"\\ntext"}, "score": float}, ...], ...]}`` (one
list per query). Without scores a server may answer bare documents; both shapes are accepted. Passages
are rendered exactly as Search-R1 does: ``Doc {i}(Title: {title}) {text}\\n`` with the title being the
first line of ``contents``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from .base import DEFAULT_MAX_OUTPUT_CHARS, Tool


class RetrievalError(RuntimeError):
    """The retrieval server could not be reached or answered something unexpected."""


def format_docs(docs: list[dict[str, Any]]) -> str:
    """Search-R1's passage rendering (``_passages2string``)."""
    out = ""
    for i, item in enumerate(docs):
        doc = item.get("document", item) if isinstance(item, dict) else {}
        content = str(doc.get("contents", doc.get("text", "")))
        lines = content.split("\n")
        out += f"Doc {i + 1}(Title: {lines[0]}) {chr(10).join(lines[1:])}\n"
    return out


class RetrievalClient:
    """Async client of ``/retrieve``; one connection pool, shareable by many concurrent episodes.

    aiohttp, not httpx: in waves of a hundred concurrent searches, as a rollout's episodes send them,
    an httpx client served 11-14x fewer queries per second and held them 3x longer at the median, its
    own CPU time being most of it (``bench/retrieval.py --client`` measures both)."""

    def __init__(
        self,
        url: str,
        topk: int = 3,
        timeout: float = 30.0,
        max_retries: int = 2,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if not self.url.endswith("/retrieve"):
            self.url += "/retrieve"
        self.topk = topk
        self.timeout = timeout
        self.max_retries = max_retries
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # No cap on connections (limit=0): the server batches whatever arrives together. Proxies from
            # the environment are never used (aiohttp's trust_env is off): the server is the run's own.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            )
            self._loop = loop
        return self._session

    async def retrieve(self, queries: list[str], topk: int | None = None) -> list[list[dict[str, Any]]]:
        """Top-k documents per query (each ``{"document": {...}, "score": float}``)."""
        body = {"queries": list(queries), "topk": topk or self.topk, "return_scores": True}
        last: BaseException | None = None
        for _ in range(self.max_retries + 1):
            try:
                async with self._http().post(self.url, json=body, headers=self.headers) as resp:
                    status, text = resp.status, await resp.text()
            except (TimeoutError, aiohttp.ClientError) as err:
                last = err
                continue
            if status >= 500:
                last = RetrievalError(f"retrieval server error {status}: {text[:200]}")
                continue
            if status != 200:
                raise RetrievalError(f"retrieval server answered {status}: {text[:200]}")
            try:
                result = json.loads(text)["result"]
            except (ValueError, KeyError, TypeError) as err:
                raise RetrievalError(f"unexpected retrieval response: {text[:200]}") from err
            if not isinstance(result, list) or len(result) != len(queries):
                raise RetrievalError(f"expected {len(queries)} result lists, got {str(result)[:200]}")
            return [
                [d if isinstance(d, dict) and "document" in d else {"document": d} for d in r] for r in result
            ]
        raise RetrievalError(f"retrieval server {self.url} unreachable: {type(last).__name__}: {last}")

    async def search(self, query: str, topk: int | None = None) -> str:
        """One query, rendered as Search-R1 passages."""
        return format_docs((await self.retrieve([query], topk))[0])

    async def close(self) -> None:
        if self._session is not None:
            if not self._session.closed and self._loop is asyncio.get_running_loop():
                await self._session.close()
            self._session = None


def search_tool(
    url: str | RetrievalClient,
    topk: int = 3,
    timeout: float = 30.0,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    api_key: str | None = None,
) -> Tool:
    """A ``search(query)`` tool backed by a retrieval server at ``url`` (``api_key``: the server's key, when
    it requires one)."""
    if isinstance(url, RetrievalClient):
        client = url
    else:
        client = RetrievalClient(url, topk=topk, timeout=timeout, api_key=api_key)

    async def search(query: str) -> str:
        """Search the knowledge corpus and return the top passages.

        Args:
            query: what to search for
        """
        return await client.search(query)

    t = Tool(search, timeout=timeout, max_output_chars=max_output_chars)
    t.client = client  # type: ignore[attr-defined]
    return t
