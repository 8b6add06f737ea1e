"""The ``search`` tool: an HTTP client of a Search-R1-compatible retrieval server.

Protocol: ``POST {url}/retrieve`` with ``{"queries": [str], "topk": int, "return_scores": true}``, answered
by ``{"result": [[{"document": {"id", "contents": "\\"Title\\"\\ntext"}, "score": float}, ...], ...]}`` (one
list per query). Without scores a server may answer bare documents; both shapes are accepted. Passages
are rendered exactly as Search-R1 does: ``Doc {i}(Title: {title}) {text}\\n`` with the title being the
first line of ``contents``.
"""

from __future__ import annotations

from typing import Any

import httpx

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
    """Async client of ``/retrieve``; one connection pool, shareable by many concurrent episodes."""

    def __init__(self, url: str, topk: int = 3, timeout: float = 30.0, max_retries: int = 2) -> None:
        self.url = url.rstrip("/")
        if not self.url.endswith("/retrieve"):
            self.url += "/retrieve"
        self.topk = topk
        self.timeout = timeout
        self.max_retries = max_retries
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None or self._client.is_closed:
            # trust_env=False: never route loopback retrieval through a proxy from the environment. No cap
            # on connections: httpx's default of 100 queued the searches of a few hundred concurrent
            # episodes behind each other (the server batches whatever arrives together anyway).
            self._client = httpx.AsyncClient(
                timeout=self.timeout,
                trust_env=False,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
            )
        return self._client

    async def retrieve(self, queries: list[str], topk: int | None = None) -> list[list[dict[str, Any]]]:
        """Top-k documents per query (each ``{"document": {...}, "score": float}``)."""
        body = {"queries": list(queries), "topk": topk or self.topk, "return_scores": True}
        last: Exception | None = None
        for _ in range(self.max_retries + 1):
            try:
                resp = await self._http().post(self.url, json=body)
            except httpx.HTTPError as err:
                last = err
                continue
            if resp.status_code >= 500:
                last = RetrievalError(f"retrieval server error {resp.status_code}: {resp.text[:200]}")
                continue
            if resp.status_code != 200:
                raise RetrievalError(f"retrieval server answered {resp.status_code}: {resp.text[:200]}")
            try:
                result = resp.json()["result"]
            except (ValueError, KeyError, TypeError) as err:
                raise RetrievalError(f"unexpected retrieval response: {resp.text[:200]}") from err
            if not isinstance(result, list) or len(result) != len(queries):
                raise RetrievalError(f"expected {len(queries)} result lists, got {str(result)[:200]}")
            return [
                [d if isinstance(d, dict) and "document" in d else {"document": d} for d in r] for r in result
            ]
        raise RetrievalError(f"retrieval server {self.url} unreachable: {last}")

    async def search(self, query: str, topk: int | None = None) -> str:
        """One query, rendered as Search-R1 passages."""
        return format_docs((await self.retrieve([query], topk))[0])

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def search_tool(
    url: str | RetrievalClient,
    topk: int = 3,
    timeout: float = 30.0,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> Tool:
    """A ``search(query)`` tool backed by a retrieval server at ``url``."""
    client = url if isinstance(url, RetrievalClient) else RetrievalClient(url, topk=topk, timeout=timeout)

    async def search(query: str) -> str:
        """Search the knowledge corpus and return the top passages.

        Args:
            query: what to search for
        """
        return await client.search(query)

    t = Tool(search, timeout=timeout, max_output_chars=max_output_chars)
    t.client = client  # type: ignore[attr-defined]
    return t
