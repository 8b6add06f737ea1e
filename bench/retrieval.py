"""Benchmark: Search-R1 /retrieve throughput over loopback HTTP against raw bm25s in-process, same run.

Builds a synthetic-world corpus (``--passages``, 10k by default), then measures queries/s for
  * raw bm25s in-process (``bm25s.tokenize`` + ``BM25.retrieve``), one batched call and one call per query
    (the baseline),
  * agentrl's ``RetrievalIndex.search`` in-process (adds passage lookup from the memory-mapped corpus),
  * the HTTP server (child process): batched requests (``--batch`` queries each) and single-query
    requests, each with one request in flight and with ``--concurrency`` in flight,
and prints ONE JSON line with the figures and their ratios to raw bm25s. Queries are the world's
question texts (what a model typically sends). Client and server share the machine's cores.

``--workers N`` adds the same HTTP figures for a server of N worker processes sharing its port
(``start_retrieval_server(workers=N)``), after the one-worker server's in the same run: keys ``wN_...``,
and ``ratio_workersN_vs_1_single`` / ``_batched`` (queries/s at ``--concurrency`` over the one-worker
server's). Each server's figures carry its own load over its run: ``server_busy_frac`` (CPU time of its
workers / (wall time x workers); a worker is one core at most) and ``requests_per_worker``.

``--client`` adds the search tool's own client (``RetrievalClient``, what ``SearchEnv`` calls) against
an ``httpx.AsyncClient`` posting the same bodies (the baseline: the client the tool had before), both
in waves of ``--wave`` concurrent one-query searches, as a rollout's episodes send them: queries/s
and the p50 / p90 latency of a search (``ratio_client_vs_httpx``: the client's queries/s over httpx's).

    python bench/retrieval.py [--passages 10000] [--queries 2000] [--concurrency 16] [--batch 32]
    python bench/retrieval.py --workers 2 [--concurrency 64]
    python bench/retrieval.py --client [--wave 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import aiohttp

from agentrl.examples.search_r1.data import write_corpus
from agentrl.examples.search_r1.retrieval_server import RetrievalIndex, import_bm25s
from agentrl.examples.search_r1.retrieval_workers import RetrievalServer, start_retrieval_server
from agentrl.examples.search_r1.world import generate_world

bm25s = import_bm25s()  # JAX kept off the GPU (see import_bm25s)


def make_corpus(passages: int, seed: int, out: Path) -> tuple[Path, list[str]]:
    """A world with at least ``passages`` passages (cut to exactly that many) and its questions."""
    rate = 0.5
    world = generate_world(
        seed, num_entities=math.ceil(passages / (1 + rate) * 1.05), num_syllables=240, distractor_rate=rate
    )
    if len(world.corpus) < passages:
        raise RuntimeError(f"world has {len(world.corpus)} passages < {passages}")
    path = write_corpus(out / "corpus.jsonl", world.corpus[:passages])
    return path, [t["prompt"] for t in world.train + world.test]


async def client_bench(url: str, queries: list[str], topk: int, wave: int) -> dict[str, float]:
    """The search tool's client against httpx, waves of ``wave`` concurrent one-query searches each."""
    import httpx

    from agentrl.tools.search import RetrievalClient

    tool = RetrievalClient(url, topk=topk)
    plain = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=None), timeout=60)

    async def with_httpx(q: str) -> None:
        r = await plain.post(f"{url}/retrieve", json={"queries": [q], "topk": topk, "return_scores": True})
        r.raise_for_status()
        r.json()

    async def waves(search) -> tuple[float, list[float]]:
        lat: list[float] = []

        async def one(q: str) -> None:
            t = time.perf_counter()
            await search(q)
            lat.append(time.perf_counter() - t)

        await asyncio.gather(*(one(q) for q in queries[:wave]))  # warm up connections
        lat.clear()
        t = time.perf_counter()
        for i in range(0, len(queries) - wave + 1, wave):
            await asyncio.gather(*(one(q) for q in queries[i : i + wave]))
        return len(lat) / (time.perf_counter() - t), sorted(lat)

    out: dict[str, float] = {}
    try:
        for name, search in (("httpx", with_httpx), ("client", tool.search)):
            rate, lat = await waves(search)
            out[f"{name}_wave{wave}_qps"] = round(rate, 1)
            out[f"{name}_wave{wave}_p50_ms"] = round(lat[len(lat) // 2] * 1000, 2)
            out[f"{name}_wave{wave}_p90_ms"] = round(lat[int(len(lat) * 0.9)] * 1000, 2)
    finally:
        await tool.close()
        await plain.aclose()
    out["ratio_client_vs_httpx"] = round(out[f"client_wave{wave}_qps"] / out[f"httpx_wave{wave}_qps"], 3)
    return out


def qps(n: int, seconds: float) -> float:
    return round(n / seconds, 1)


async def http_bench(
    url: str, queries: list[str], topk: int, batch: int, concurrency: int
) -> dict[str, float]:
    """Queries/s for batched and single-query requests, sequential and concurrent."""
    lat: list[float] = []

    async def post(session: aiohttp.ClientSession, qs: list[str]) -> None:
        t = time.perf_counter()
        async with session.post(
            f"{url}/retrieve", json={"queries": qs, "topk": topk, "return_scores": True}
        ) as r:
            r.raise_for_status()
            body = await r.json()
            assert len(body["result"]) == len(qs)
        lat.append(time.perf_counter() - t)

    async def run(chunks: list[list[str]], inflight: int) -> float:
        sem = asyncio.Semaphore(inflight)

        async def one(qs: list[str]) -> None:
            async with sem:
                await post(session, qs)

        t = time.perf_counter()
        await asyncio.gather(*(one(c) for c in chunks))
        return time.perf_counter() - t

    out: dict[str, float] = {}
    connector = aiohttp.TCPConnector(limit=max(concurrency, 1))
    async with aiohttp.ClientSession(connector=connector) as session:
        await run([[q] for q in queries[:50]], concurrency)  # warm up connections
        batches = [queries[i : i + batch] for i in range(0, len(queries), batch)]
        singles = [[q] for q in queries]
        out["http_batched_seq_qps"] = qps(len(queries), await run(batches, 1))
        out[f"http_batched_c{concurrency}_qps"] = qps(len(queries), await run(batches, concurrency))
        n_seq = min(len(singles), 500)
        lat.clear()
        out["http_single_seq_qps"] = qps(n_seq, await run(singles[:n_seq], 1))
        out["http_single_seq_p50_ms"] = round(statistics.median(lat) * 1000, 2)
        lat.clear()
        out[f"http_single_c{concurrency}_qps"] = qps(len(singles), await run(singles, concurrency))
        out[f"http_single_c{concurrency}_p50_ms"] = round(statistics.median(lat) * 1000, 2)
    return out


def measured(server: RetrievalServer, bench: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """``bench``'s figures, with the server's own over it: the CPU time of its workers / (wall time x
    workers), and the requests each worker served."""
    before, t0 = server.stats(), time.monotonic()
    out = asyncio.run(bench)
    wall = time.monotonic() - t0
    time.sleep(0.6)  # every worker's CPU time is brought up to date twice a second (idle meanwhile)
    after = server.stats()
    out["server_busy_frac"] = round((after["cpu_s"] - before["cpu_s"]) / (wall * after["workers"]), 3)
    out["requests_per_worker"] = [int(w["requests"]) for w in after["per_worker"]]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--passages", type=int, default=10_000)
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="queries per batched HTTP request")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight for the concurrent runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="also a server of this many workers (> 1)")
    p.add_argument("--client", action="store_true", help="also the search tool's client against httpx")
    p.add_argument("--wave", type=int, default=100, help="--client: concurrent one-query searches per wave")
    a = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="agentrl-bench-retrieval-") as tmp:
        corpus, questions = make_corpus(a.passages, a.seed, Path(tmp))
        queries = (questions * math.ceil(a.queries / len(questions)))[: a.queries]
        texts = [json.loads(line)["contents"] for line in corpus.read_text().splitlines()]

        # Baseline: raw bm25s, in-process, single-threaded.
        t = time.perf_counter()
        raw = bm25s.BM25(method="lucene")
        raw.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
        raw_index_s = time.perf_counter() - t
        t = time.perf_counter()
        raw.retrieve(
            bm25s.tokenize(queries, stopwords="en", show_progress=False), k=a.topk, show_progress=False
        )
        raw_batched = qps(len(queries), time.perf_counter() - t)
        n_single = min(len(queries), 500)
        t = time.perf_counter()
        for q in queries[:n_single]:
            raw.retrieve(
                bm25s.tokenize([q], stopwords="en", show_progress=False), k=a.topk, show_progress=False
            )
        raw_single = qps(n_single, time.perf_counter() - t)

        # agentrl's index in-process: cold build (writes the cache), cache load, search.
        t = time.perf_counter()
        RetrievalIndex(corpus).close()
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        index = RetrievalIndex(corpus)
        load_s = time.perf_counter() - t
        assert index.cache_hit
        t = time.perf_counter()
        index.search(queries, a.topk)
        index_qps = qps(len(queries), time.perf_counter() - t)
        index.close()

        with start_retrieval_server(corpus) as server:
            http = measured(server, http_bench(server.url, queries, a.topk, a.batch, a.concurrency))
            if a.client:
                http.update(asyncio.run(client_bench(server.url, queries, a.topk, a.wave)))
        if a.workers > 1:
            with start_retrieval_server(corpus, workers=a.workers) as server:
                many = measured(server, http_bench(server.url, queries, a.topk, a.batch, a.concurrency))
            c, w = a.concurrency, a.workers
            http.update({f"w{w}_{k}": v for k, v in many.items()})
            for kind in ("single", "batched"):
                key = f"http_{kind}_c{c}_qps"
                http[f"ratio_workers{w}_vs_1_{kind}"] = round(many[key] / http[key], 3)

    c = a.concurrency
    result = {
        "bench": "retrieval",
        "passages": a.passages,
        "queries": len(queries),
        "topk": a.topk,
        "batch": a.batch,
        "concurrency": c,
        "workers": a.workers,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "bm25s": bm25s.__version__,
        "raw_bm25s_index_s": round(raw_index_s, 3),
        "index_build_s": round(build_s, 3),
        "index_cache_load_s": round(load_s, 3),
        "raw_bm25s_batched_qps": raw_batched,
        "raw_bm25s_single_qps": raw_single,
        "index_search_qps": index_qps,
        **http,
        "ratio_index_vs_raw_batched": round(index_qps / raw_batched, 3),
        "ratio_http_batched_vs_raw_batched": round(http[f"http_batched_c{c}_qps"] / raw_batched, 3),
        "ratio_http_single_vs_raw_single": round(http[f"http_single_c{c}_qps"] / raw_single, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
