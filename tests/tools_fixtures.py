"""A real /retrieve server on loopback (aiohttp, port 0) over a tiny corpus, for tool and env tests.

It speaks the Search-R1 retrieval protocol and records every request body it receives.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

CORPUS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
    {"id": "2", "contents": '"Eiffel Tower"\nThe Eiffel Tower is a tower in Paris.\nIt was built in 1889.'},
    {"id": "3", "contents": '"Rome"\nRome is the capital of Italy.'},
]


@dataclass
class RetrievalServer:
    url: str
    requests: list[dict] = field(default_factory=list)
    fail_next: int = 0  # answer the next N requests with HTTP 500


def _rank(query: str, k: int) -> list[dict]:
    words = set(query.lower().split())
    scored = [(len(words & set(d["contents"].lower().replace(".", " ").split())), d) for d in CORPUS]
    scored.sort(key=lambda x: (-x[0], x[1]["id"]))
    return [{"document": d, "score": float(s)} for s, d in scored[:k]]


@contextlib.asynccontextmanager
async def retrieval_server() -> AsyncIterator[RetrievalServer]:
    state = RetrievalServer(url="")

    async def retrieve(request: web.Request) -> web.Response:
        body = await request.json()
        state.requests.append(body)
        if state.fail_next > 0:
            state.fail_next -= 1
            return web.Response(status=500, text="injected failure")
        results = [_rank(q, int(body.get("topk", 3))) for q in body["queries"]]
        if not body.get("return_scores", False):
            results = [[r["document"] for r in rs] for rs in results]
        return web.json_response({"result": results})

    app = web.Application()
    app.router.add_post("/retrieve", retrieve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()
