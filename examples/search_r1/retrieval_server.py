"""BM25 retrieval for Search-R1: an in-process index and the ``/retrieve`` HTTP server around it.

:class:`RetrievalIndex` builds a bm25s index over a Search-R1 corpus jsonl (``{"id", "contents"}`` per
line), caches it next to the corpus (``<corpus>.bm25s/``, rebuilt when the corpus file changes) and
reads passages back through a memory map of the corpus, so a large corpus is not held in Python objects.

The server speaks Search-R1's API: ``POST /retrieve {"queries": [str], "topk": int, "return_scores":
bool}`` -> ``{"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}``, one list per
query; with ``return_scores`` false each hit is the document dict itself (the original server breaks
there). Only passages sharing a term with the query are returned, so a list may be shorter than
``topk``. Concurrent requests are coalesced into one batched search in a worker thread, keeping the
event loop free. Malformed or oversized requests get a JSON ``{"error": ...}`` with status 400 (413 for a
body over ``--max-body-bytes``). ``GET /health`` -> ``{"status": "ok", "num_docs": N}``; ``GET /stats`` ->
the server's cumulative counters (requests, server-side seconds, time queued, CPU seconds, requests in
flight; summed over its workers, see :mod:`.retrieval_workers`). It binds loopback unless given a key
(``--api-key``, or ``$AGENTRL_API_KEY``, which keeps it out of the process list): with one, ``/retrieve``
and ``/stats`` require ``Authorization: Bearer KEY`` (``/health`` stays open).

CLI: ``python -m agentrl.examples.search_r1.retrieval_server --corpus FILE --host 127.0.0.1 --port N
[--workers W]``. From Python, :func:`start_retrieval_server` (:mod:`.retrieval_workers`) runs it in
``workers`` child processes sharing one port, which exit with their parent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.cluster import API_KEY_ENV, bearer_matches, bind_address, is_loopback

from .data import format_docs
from .retrieval_workers import RetrievalServer as RetrievalServer  # the process handle lives there
from .retrieval_workers import StatsBoard, start_retrieval_server

Hit = dict[str, Any]  # {"document": {"id", "contents", ...}, "score": float}


def import_bm25s() -> Any:
    """``bm25s``, imported with JAX kept on the CPU: bm25s imports JAX when it is installed (its optional
    top-k backend), and JAX then claims 75% of the GPU's memory for itself in every process that imports
    bm25s. Seen on an H100 with JAX installed: the bootstrap SFT ran out of memory with 60 GB held by
    JAX. This index never uses JAX. Set ``JAX_PLATFORMS`` yourself to override."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    return bm25s


_TOKEN_RE = re.compile(r"(?u)\b\w\w+\b")  # bm25s' default token pattern (scikit-learn's)
_CACHE_FORMAT = 1


class _Tokenizer:
    """bm25s' default tokenization (lowercase, \\w\\w+, English stopwords, no stemming), kept here so
    queries map straight to index ids without building a throwaway vocabulary per call."""

    def __init__(self) -> None:
        self.stopwords = frozenset(import_bm25s().stopwords.STOPWORDS_EN)

    def __call__(self, text: str) -> list[str]:
        return [t for t in _TOKEN_RE.findall(text.lower()) if t not in self.stopwords]


class RetrievalIndex:
    """A bm25s index over passages; ``search(queries, topk)`` returns Search-R1 hits per query.

    ``corpus`` is a jsonl path (indexed with an on-disk cache unless ``cache=False``) or an iterable of
    ``{"id", "contents"}`` dicts (indexed in memory). ``mapped``: the index is read from its cache through
    read-only memory maps (a fresh build is saved, then mapped), so processes serving one corpus share
    its pages instead of holding a copy each.
    """

    def __init__(
        self,
        corpus: str | Path | Iterable[dict[str, Any]],
        cache: bool = True,
        k1: float = 1.5,
        b: float = 0.75,
        mapped: bool = False,
    ) -> None:
        bm25s = import_bm25s()
        self._tokenize = _Tokenizer()
        self._params = {
            "k1": k1,
            "b": b,
            "method": "lucene",
            "bm25s": bm25s.__version__,
            "format": _CACHE_FORMAT,
        }
        self._docs: list[dict[str, Any]] | None = None
        self._mm: mmap.mmap | None = None
        self.corpus_path: Path | None = None
        self.cache_hit = False
        self.mapped = False  # the index arrays are memory maps of the cache (see ``mapped``)
        if isinstance(corpus, str | Path):
            self.corpus_path = Path(corpus)
            self._open_file(cache, mapped)
        else:
            self._docs = [dict(d) for d in corpus]
            self._retriever = self._build([d["contents"] for d in self._docs])
        self._vocab: dict[str, int] = self._retriever.vocab_dict
        self.num_docs = int(self._retriever.scores["num_docs"])

    # ---- building / caching
    def _build(self, texts: list[str]):
        bm25s = import_bm25s()
        tokens = bm25s.tokenize(texts, stopwords="en", show_progress=False)
        retriever = bm25s.BM25(k1=self._params["k1"], b=self._params["b"], method="lucene")
        retriever.index(tokens, show_progress=False)
        return retriever

    def _fingerprint(self) -> dict[str, Any]:
        st = self.corpus_path.stat()
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, **self._params}

    def _load_cache(self, cache_dir: Path, mapped: bool) -> None:
        retriever = import_bm25s().BM25.load(str(cache_dir), mmap=mapped, show_progress=False, verbosity=0)
        if mapped:  # plain arrays over the maps: np.memmap's subclass overhead cost a tenth of search speed
            for key in ("data", "indices", "indptr"):
                retriever.scores[key] = np.asarray(retriever.scores[key])
        self._retriever = retriever
        self._offsets = np.load(cache_dir / "offsets.npy", mmap_mode="r" if mapped else None)
        self.mapped = mapped

    def _open_file(self, cache: bool, mapped: bool) -> None:
        path = self.corpus_path
        if not path.is_file():
            raise FileNotFoundError(f"corpus file not found: {path}")
        if path.suffix == ".gz":
            raise ValueError(f"{path}: gunzip the corpus first (the index memory-maps the jsonl)")
        cache_dir = path.with_name(path.name + ".bm25s")
        fp = self._fingerprint()
        meta = cache_dir / "meta.json"
        if cache and meta.is_file():
            try:
                if json.loads(meta.read_text()).get("fingerprint") == fp:
                    self._load_cache(cache_dir, mapped)
                    self.cache_hit = True
            except (OSError, ValueError):
                self.cache_hit = False  # a corrupt cache is rebuilt below
        if path.stat().st_size == 0:
            raise ValueError(f"corpus file is empty: {path}")
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self.cache_hit:
            return
        offsets, texts = [], []
        pos, mm = 0, self._mm
        while pos < len(mm):
            end = mm.find(b"\n", pos)
            end = len(mm) if end < 0 else end
            line = mm[pos:end]
            if line.strip():
                try:
                    texts.append(json.loads(line)["contents"])
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ValueError(
                        f"{path}: line {len(offsets) + 1} is not {{'id', 'contents'}}: {err}"
                    ) from None
                offsets.append(pos)
            pos = end + 1
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._retriever = self._build(texts)
        if cache and self._save_cache(cache_dir, fp) and mapped:
            with contextlib.suppress(OSError, ValueError):  # else the built index in memory serves
                self._load_cache(cache_dir, mapped)

    def _save_cache(self, cache_dir: Path, fp: dict[str, Any]) -> bool:
        # Build in a private temp dir and rename it into place, so concurrent builders never see half a cache.
        try:
            tmp = Path(tempfile.mkdtemp(prefix=cache_dir.name + ".tmp", dir=cache_dir.parent))
        except OSError:
            return False  # read-only location: run without a cache
        try:
            self._retriever.save(str(tmp), show_progress=False)
            np.save(tmp / "offsets.npy", self._offsets)
            (tmp / "meta.json").write_text(json.dumps({"fingerprint": fp}))
            if cache_dir.exists():
                shutil.rmtree(cache_dir, ignore_errors=True)
            os.replace(tmp, cache_dir)
            return True
        except OSError:
            return False  # another process won the race, or the disk is full: the in-memory index still works
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- lookup
    def __len__(self) -> int:
        return self.num_docs

    def document(self, i: int) -> dict[str, Any]:
        """Passage ``i`` (index order) as its corpus dict."""
        if self._docs is not None:
            return self._docs[i]
        start = int(self._offsets[i])
        end = self._mm.find(b"\n", start)
        return json.loads(self._mm[start : end if end >= 0 else len(self._mm)])

    def token_ids(self, query: str) -> list[int]:
        vocab = self._vocab
        return [vocab[t] for t in self._tokenize(query) if t in vocab]

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[Hit]]:
        """For each query, up to ``topk`` hits ``{"document", "score"}``, best first (score > 0 only)."""
        out: list[list[Hit]] = []
        for q in queries:
            ids = self.token_ids(q)
            if not ids:
                out.append([])
                continue
            scores = self._retriever.get_scores_from_ids(ids)
            k = min(topk, len(scores))
            top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
            top = top[np.argsort(-scores[top], kind="stable")]
            out.append(
                [{"document": self.document(int(i)), "score": float(scores[i])} for i in top if scores[i] > 0]
            )
        return out

    async def asearch(self, queries: Sequence[str], topk: int = 3) -> list[list[Hit]]:
        """:meth:`search` on a worker thread, for the episode path."""
        return await asyncio.to_thread(self.search, queries, topk)

    def search_fn(self, topk: int = 3) -> Callable[[str], str]:
        """``query -> formatted docs`` (Search-R1's ``Doc i(Title: ...) text`` lines), e.g. for gold demos."""
        return lambda query: format_docs(self.search([query], topk)[0])

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


# --------------------------------------------------------------------------------------------------------
# HTTP server


@dataclass
class ServerLimits:
    """Request bounds; anything beyond them is a 400 (413 for the body size) naming the limit."""

    max_queries: int = 1024
    max_topk: int = 100
    max_query_chars: int = 4096
    max_body_bytes: int = 4 * 1024 * 1024
    default_topk: int = 3


_FIELDS = ("queries", "topk", "return_scores")


class BadRequest(ValueError):
    """The client sent something the API does not accept; the message goes back in the 400 body."""


def parse_request(body: Any, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """Validate a /retrieve body -> (queries, topk, return_scores); raises :class:`BadRequest`."""
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object with {list(_FIELDS)}, got {type(body).__name__}")
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; allowed: {list(_FIELDS)}")
    if "queries" not in body:
        raise BadRequest("missing field 'queries' (a list of strings)")
    queries = body["queries"]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest("'queries' must be a list of strings")
    if not queries:
        raise BadRequest("'queries' is empty")
    if len(queries) > limits.max_queries:
        raise BadRequest(f"too many queries: {len(queries)} > max_queries={limits.max_queries}")
    longest = max(len(q) for q in queries)
    if longest > limits.max_query_chars:
        raise BadRequest(f"query too long: {longest} chars > max_query_chars={limits.max_query_chars}")
    topk = body.get("topk", limits.default_topk)
    if topk is None:
        topk = limits.default_topk
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= limits.max_topk:
        raise BadRequest(f"'topk' must be an integer in [1, {limits.max_topk}], got {topk!r}")
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise BadRequest(f"'return_scores' must be a boolean, got {return_scores!r}")
    return queries, topk, return_scores


class _Batcher:
    """Coalesces concurrent requests into one ``index.search`` call on a worker thread.

    bm25s is CPU-bound and mostly holds the GIL, so several threads would not search faster (several
    worker processes do: :mod:`.retrieval_workers`); one thread draining everything queued meanwhile
    keeps per-request overhead low under load and the loop free.
    """

    def __init__(self, index: RetrievalIndex, max_batch: int, board: StatsBoard) -> None:
        self.index, self.max_batch, self.board = index, max_batch, board
        self.queue: asyncio.Queue[tuple[list[str], int, asyncio.Future, float]] = asyncio.Queue()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((queries, topk, fut, time.perf_counter()))
        return await fut

    async def _run(self) -> None:
        board = self.board
        while True:
            jobs = [await self.queue.get()]
            n = len(jobs[0][0])
            while n < self.max_batch and not self.queue.empty():
                jobs.append(self.queue.get_nowait())
                n += len(jobs[-1][0])
            queries = [q for qs, _, _, _ in jobs for q in qs]
            topk = max(k for _, k, _, _ in jobs)
            t0 = time.perf_counter()
            board.add("queue_s", sum(t0 - queued for _, _, _, queued in jobs))
            try:
                results = await asyncio.to_thread(self.index.search, queries, topk)
            except Exception as err:  # one bad batch fails its requests, not the server
                for _, _, fut, _ in jobs:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            finally:
                board.add("search_s", time.perf_counter() - t0)
                board.tick()
            pos = 0
            for qs, k, fut, _ in jobs:
                if not fut.done():
                    fut.set_result([hits[:k] for hits in results[pos : pos + len(qs)]])
                pos += len(qs)


def _json_error(status: int, message: str):
    from aiohttp import web

    return web.json_response({"error": message}, status=status)


def build_app(
    index: RetrievalIndex,
    limits: ServerLimits | None = None,
    board: StatsBoard | None = None,
    api_key: str | None = None,
):
    """The aiohttp application serving ``index`` (``/retrieve``, ``/health``, ``/stats``); it counts its
    work in ``board`` (a worker's row of the server's shared board; default: a private one). With
    ``api_key`` every path but ``/health`` requires it as a Bearer token."""
    from aiohttp import web

    limits = limits or ServerLimits()
    board = board or StatsBoard()
    board.begin()
    batcher = _Batcher(index, max(limits.max_queries, 256), board)

    async def retrieve(request: web.Request) -> web.Response:
        t0, queries = time.perf_counter(), 0
        board.add("inflight", 1)
        try:
            response, queries = await answer(request)
            return response
        finally:
            board.add("inflight", -1)
            if queries:
                board.add("requests")
                board.add("queries", queries)
                board.add("request_s", time.perf_counter() - t0)
            else:  # rejected, or failed (the middleware answers 500)
                board.add("errors")

    async def answer(request: web.Request) -> tuple[web.Response, int]:
        """The response and, when the request was searched, its number of queries (else 0)."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _json_error(413, f"request body larger than max_body_bytes={limits.max_body_bytes}"), 0
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _json_error(400, f"body is not valid JSON: {err}"), 0
        try:
            queries, topk, return_scores = parse_request(body, limits)
        except BadRequest as err:
            return _json_error(400, str(err)), 0
        results = await batcher.search(queries, topk)
        if not return_scores:
            results = [[hit["document"] for hit in hits] for hits in results]
        return web.json_response({"result": results}), len(queries)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "num_docs": index.num_docs})

    async def stats(request: web.Request) -> web.Response:
        board.tick()
        return web.json_response(board.totals())

    @web.middleware
    async def errors(request: web.Request, handler):
        if api_key and request.path != "/health":
            if not bearer_matches(request.headers.get("Authorization", ""), api_key):
                return _json_error(401, "missing or invalid key (Authorization: Bearer <key>)")
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _json_error(exc.status, exc.reason)
        except Exception as err:  # report, keep serving
            return _json_error(500, f"{type(err).__name__}: {err}")

    async def on_startup(app: web.Application) -> None:
        batcher.start()

    async def on_cleanup(app: web.Application) -> None:
        await batcher.stop()

    app = web.Application(client_max_size=limits.max_body_bytes, middlewares=[errors])
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def check_exposure(host: str, api_key: str | None) -> None:
    """A ValueError when ``host`` is off loopback and no key guards it."""
    if not api_key and not is_loopback(host):
        raise ValueError(f"refusing to serve on non-loopback host {host!r} without a key (--api-key)")


async def serve(
    corpus: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    parent_pid: int | None = None,
    ready: Callable[[dict[str, Any]], None] | None = None,
    board: StatsBoard | None = None,
    reuse_port: bool = False,
) -> None:
    """Build (or load) the index, serve until SIGINT/SIGTERM (or until ``parent_pid`` is gone).
    ``reuse_port``: bind with ``SO_REUSEPORT``, sharing the port with the server's other workers."""
    from aiohttp import web

    host = bind_address(host)
    check_exposure(host, api_key)
    board = board or StatsBoard()
    t0 = time.perf_counter()
    index = await asyncio.to_thread(RetrievalIndex, corpus, mapped=True)
    build_s = time.perf_counter() - t0
    runner = web.AppRunner(build_app(index, limits, board, api_key), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    await site.start()
    bound_port = runner.addresses[0][1]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url_host = f"[{host}]" if ":" in host else host
    if ready is not None:
        ready(
            {
                "event": "ready",
                "url": f"http://{url_host}:{bound_port}",
                "port": bound_port,
                "pid": os.getpid(),
                "num_docs": index.num_docs,
                "index_s": round(build_s, 3),
                "cache_hit": index.cache_hit,
                "mapped": index.mapped,
            }
        )
    try:
        while not stop.is_set():
            # Exit with the parent (a crashed trainer must not leave this server behind).
            if parent_pid is not None and os.getppid() != parent_pid:
                break
            board.tick()  # fresh for /stats answered by another worker
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
    finally:
        await runner.cleanup()
        index.close()


def main(argv: list[str] | None = None) -> None:
    d = ServerLimits()
    p = argparse.ArgumentParser(description="Search-R1 /retrieve server (BM25 via bm25s).")
    p.add_argument("--corpus", required=True, help="corpus jsonl: one {'id', 'contents'} per line")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless a key is given)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed in the ready line)")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"required as 'Authorization: Bearer KEY' on /retrieve and /stats (default: ${API_KEY_ENV})",
    )
    p.add_argument("--max-queries", type=int, default=d.max_queries, help="queries per request")
    p.add_argument("--max-topk", type=int, default=d.max_topk)
    p.add_argument("--default-topk", type=int, default=d.default_topk, help="topk when a request omits it")
    p.add_argument("--max-query-chars", type=int, default=d.max_query_chars)
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is no longer our parent"
    )
    p.add_argument("--workers", type=int, default=1, help="server processes sharing the port (Linux)")
    # set by start_retrieval_server for each worker it starts
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--board-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    limits = ServerLimits(
        max_queries=a.max_queries,
        max_topk=a.max_topk,
        max_query_chars=a.max_query_chars,
        max_body_bytes=a.max_body_bytes,
        default_topk=a.default_topk,
    )

    def ready(info: dict[str, Any]) -> None:
        print(json.dumps(info), flush=True)

    try:
        if a.worker_index is None and a.workers > 1:  # the CLI's own workers: start them, wait for a signal
            check_exposure(bind_address(a.host), a.api_key)
            with start_retrieval_server(
                a.corpus, a.port, a.host, limits=limits, workers=a.workers, api_key=a.api_key
            ) as server:
                ready({**server.info, "pids": server.pids})
                stop = {signal.SIGINT, signal.SIGTERM}
                signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # after the start: workers keep theirs
                signal.sigwait(stop)
            return
        board = None if a.board_fd is None else StatsBoard(a.workers, a.board_fd, a.worker_index or 0)
        asyncio.run(
            serve(a.corpus, a.host, a.port, limits, a.api_key, a.parent_pid, ready, board, a.reuse_port)
        )
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
