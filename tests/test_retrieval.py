"""BM25 retrieval for the Search-R1 example: the in-process index (agreement with raw bm25s, on-disk
cache), and the /retrieve server over real loopback HTTP (API shape, batching, errors, lifecycle)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import pytest

from agentrl.examples.search_r1.retrieval_server import (
    RetrievalIndex,
    ServerLimits,
    import_bm25s,
    is_loopback,
    start_retrieval_server,
)
from agentrl.examples.search_r1.world import generate_world
from agentrl.testing.processes import pid_alive

bm25s = import_bm25s()  # JAX kept off the GPU (see import_bm25s)


@pytest.fixture(scope="module")
def world():
    return generate_world(seed=0)


@pytest.fixture(scope="module")
def corpus_file(world, tmp_path_factory) -> Path:
    return world.write(tmp_path_factory.mktemp("world"))["corpus"]


@pytest.fixture(scope="module")
def server(corpus_file):
    handle = start_retrieval_server(
        corpus_file,
        limits=ServerLimits(max_queries=64, max_topk=20, max_query_chars=500, max_body_bytes=64 * 1024),
    )
    yield handle
    handle.stop()


# ---- in-process index


def test_index_matches_raw_bm25s(world):
    texts = [p["contents"] for p in world.corpus]
    raw = bm25s.BM25(method="lucene")
    raw.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    index = RetrievalIndex(world.corpus)
    queries = [t["prompt"] for t in world.test[:40]] + [t["info"]["subject_name"] for t in world.test[:40]]
    ours = index.search(queries, topk=5)
    docs, scores = raw.retrieve(
        bm25s.tokenize(queries, stopwords="en", show_progress=False), k=5, show_progress=False
    )
    for q, hits, d, s in zip(queries, ours, docs, scores, strict=True):
        assert hits, q
        np.testing.assert_allclose([h["score"] for h in hits], s[: len(hits)], rtol=1e-5)
        assert hits[0]["document"]["contents"] == texts[d[0]] or np.isclose(s[0], s[1])


def test_index_hits_are_sorted_bounded_and_matching(world):
    index = RetrievalIndex(world.corpus)
    (hits,) = index.search([world.test[0]["info"]["subject_name"]], topk=4)
    scores = [h["score"] for h in hits]
    assert 1 <= len(hits) <= 4 and scores == sorted(scores, reverse=True) and min(scores) > 0
    assert set(hits[0]["document"]) == {"id", "contents"}
    # Stopwords only, unknown words, and empty queries match nothing (no zero-score filler).
    assert index.search(["the of and", "Qqqzzyx", ""], topk=3) == [[], [], []]
    assert len(index.search(["city"], topk=1000)[0]) < len(index)


def test_file_index_caches_and_rebuilds_on_change(world, tmp_path):
    corpus = world.write(tmp_path)["corpus"]
    first = RetrievalIndex(corpus)
    assert not first.cache_hit and (tmp_path / "corpus.jsonl.bm25s" / "meta.json").is_file()
    second = RetrievalIndex(corpus)
    assert second.cache_hit
    q = [t["prompt"] for t in world.test[:20]]
    assert second.search(q, 3) == first.search(q, 3) == RetrievalIndex(world.corpus).search(q, 3)
    time.sleep(0.01)
    with open(corpus, "a") as f:
        f.write(json.dumps({"id": "new", "contents": '"Zyxxor"\nZyxxor is a new passage.'}) + "\n")
    third = RetrievalIndex(corpus)
    assert not third.cache_hit and len(third) == len(first) + 1
    assert third.search(["Zyxxor"], 3)[0][0]["document"]["id"] == "new"
    assert RetrievalIndex(corpus, cache=True).cache_hit
    for idx in (first, second, third):
        idx.close()


def test_mapped_index_reads_its_cache_through_memory_maps(world, tmp_path):
    corpus = world.write(tmp_path)["corpus"]
    built = RetrievalIndex(corpus, mapped=True)  # built, saved, then mapped from the cache
    loaded = RetrievalIndex(corpus, mapped=True)
    assert not built.cache_hit and loaded.cache_hit and built.mapped and loaded.mapped
    assert not RetrievalIndex(corpus).mapped
    q = [t["prompt"] for t in world.test[:20]]
    assert built.search(q, 3) == loaded.search(q, 3) == RetrievalIndex(world.corpus).search(q, 3)
    assert isinstance(loaded._retriever.scores["data"].base, np.memmap)  # a view of the map, not a copy
    for idx in (built, loaded):
        idx.close()


def test_concurrent_builders_share_one_cache(world, tmp_path):
    corpus = world.write(tmp_path)["corpus"]
    with ThreadPoolExecutor(4) as pool:
        built = list(pool.map(lambda _: RetrievalIndex(corpus), range(4)))
    q = [t["prompt"] for t in world.test[:10]]
    expected = built[0].search(q, 3)
    assert all(b.search(q, 3) == expected for b in built)
    again = RetrievalIndex(corpus)
    assert again.cache_hit and again.search(q, 3) == expected
    assert sorted(p.name for p in tmp_path.iterdir() if ".bm25s" in p.name) == ["corpus.jsonl.bm25s"]


async def test_async_search_and_search_fn(world):
    index = RetrievalIndex(world.corpus)
    # a subject whose name occurs in at least two passages, so that topk=2 returns two docs
    name = next(n for t in world.test if len(index.search([n := t["info"]["subject_name"]], 3)[0]) >= 2)
    assert await index.asearch([name], 3) == index.search([name], 3)
    docs = index.search_fn(topk=2)(name)
    assert docs.startswith('Doc 1(Title: "') and docs.count("\nDoc ") == 1 and docs.endswith("\n")


def test_index_rejects_bad_corpus(tmp_path):
    with pytest.raises(FileNotFoundError):
        RetrievalIndex(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "x"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2"):
        RetrievalIndex(bad)


# ---- the HTTP server


def test_retrieve_api_shape_with_and_without_scores(server, world):
    queries = [world.test[0]["info"]["subject_name"], world.test[1]["prompt"]]
    with_scores = httpx.post(
        f"{server.url}/retrieve", json={"queries": queries, "topk": 3, "return_scores": True}
    )
    assert with_scores.status_code == 200
    result = with_scores.json()["result"]
    assert len(result) == 2
    for hits in result:
        assert 1 <= len(hits) <= 3
        for hit in hits:
            assert set(hit) == {"document", "score"} and isinstance(hit["score"], float)
            assert set(hit["document"]) == {"id", "contents"} and hit["document"]["contents"].startswith('"')
    no_scores = httpx.post(
        f"{server.url}/retrieve", json={"queries": queries, "topk": 3, "return_scores": False}
    )
    assert no_scores.status_code == 200
    assert no_scores.json()["result"] == [[h["document"] for h in hits] for hits in result]
    # return_scores and topk are optional (Search-R1 defaults: no scores, the server's default topk of 3).
    default = httpx.post(f"{server.url}/retrieve", json={"queries": queries}).json()["result"]
    assert default == no_scores.json()["result"]
    # The server answers exactly what the in-process index answers.
    assert result == RetrievalIndex(world.corpus).search(queries, 3)


def test_batched_and_concurrent_requests_agree(server, world):
    queries = [t["prompt"] for t in world.test[:50]]
    expected = RetrievalIndex(world.corpus).search(queries, 5)
    batched = httpx.post(
        f"{server.url}/retrieve", json={"queries": queries, "topk": 5, "return_scores": True}
    )
    assert batched.json()["result"] == expected

    async def one(session: aiohttp.ClientSession, q: str, k: int):
        async with session.post(
            f"{server.url}/retrieve", json={"queries": [q], "topk": k, "return_scores": True}
        ) as r:
            assert r.status == 200
            return (await r.json())["result"][0]

    async def many():
        async with aiohttp.ClientSession() as s:  # mixed topk in flight together: coalesced, then split
            return await asyncio.gather(*(one(s, q, 2 + i % 4) for i, q in enumerate(queries)))

    got = asyncio.run(many())
    assert got == [hits[: 2 + i % 4] for i, hits in enumerate(expected)]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "JSON object"),
        ({"topk": 3}, "missing field 'queries'"),
        ({"queries": "who"}, "list of strings"),
        ({"queries": [1]}, "list of strings"),
        ({"queries": []}, "empty"),
        ({"queries": ["q"] * 65}, "too many queries: 65 > max_queries=64"),
        ({"queries": ["x" * 501]}, "query too long"),
        ({"queries": ["q"], "topk": 0}, "'topk' must be an integer in [1, 20]"),
        ({"queries": ["q"], "topk": 21}, "'topk' must be an integer"),
        ({"queries": ["q"], "topk": "3"}, "'topk' must be an integer"),
        ({"queries": ["q"], "topk": True}, "'topk' must be an integer"),
        ({"queries": ["q"], "return_scores": "yes"}, "'return_scores' must be a boolean"),
        ({"queries": ["q"], "top_k": 3}, "unknown field(s) ['top_k']"),
    ],
)
def test_bad_requests_get_400_with_a_message(server, body, message):
    r = httpx.post(f"{server.url}/retrieve", json=body)
    assert r.status_code == 400
    assert message in r.json()["error"]


def test_malformed_and_oversized_bodies(server):
    r = httpx.post(
        f"{server.url}/retrieve", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    big = json.dumps({"queries": ["word " * 90] * 200}).encode()  # > 64 KiB
    r = httpx.post(f"{server.url}/retrieve", content=big)
    assert r.status_code == 413 and "max_body_bytes=65536" in r.json()["error"]
    r = httpx.get(f"{server.url}/retrieve")
    assert r.status_code == 405 and "error" in r.json()
    # The server keeps serving after all of that.
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["num_docs"] > 0


def test_loopback_only_by_default(corpus_file):
    assert (
        is_loopback("127.0.0.1")
        and is_loopback("::1")
        and is_loopback("localhost")
        and is_loopback("127.5.0.1")
    )
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.org")
    # The CLI refuses before it binds anything.
    server = [
        sys.executable,
        "-m",
        "agentrl.examples.search_r1.retrieval_server",
        "--corpus",
        str(corpus_file),
    ]
    out = subprocess.run(
        [*server, "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "refusing to serve on non-loopback host" in out.stderr


def test_server_lifecycle_leaves_no_process(corpus_file):
    with start_retrieval_server(corpus_file) as s:
        pid = s.pid
        assert pid_alive(pid) and httpx.get(f"{s.url}/health").status_code == 200
    assert not pid_alive(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{s.url}/health", timeout=2)
    s.stop()  # idempotent


@pytest.mark.parametrize("workers", [1, 2])
def test_server_exits_with_its_parent(corpus_file, workers):
    """A parent that dies without cleanup (os._exit: no atexit) does not leave the server behind."""
    code = (
        "import os, sys\n"
        "from agentrl.examples.search_r1.retrieval_server import start_retrieval_server\n"
        f"s = start_retrieval_server({str(corpus_file)!r}, workers={workers})\n"
        "print(*s.pids, flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == workers
    deadline = time.monotonic() + 10
    while any(map(pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(pid_alive, pids))


def _children() -> list[int]:
    """Live (non-zombie) child processes of this test process."""
    kids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                kids.append(int(p))
    return kids


@pytest.mark.parametrize("workers", [1, 2])
def test_startup_failure_is_reported_and_cleaned_up(tmp_path, workers):
    before = set(_children())
    with pytest.raises(RuntimeError, match="corpus file not found"):
        start_retrieval_server(tmp_path / "missing.jsonl", timeout=60, workers=workers)
    assert set(_children()) <= before
    with pytest.raises(ValueError, match="at least 1"):
        start_retrieval_server(tmp_path / "missing.jsonl", workers=0)


async def test_gold_demo_matches_search_env_byte_for_byte(server, world):
    """The SFT demonstrations show exactly what SearchEnv shows the model during RL (same server)."""
    from agentrl.envs.search import PROMPT, SearchEnv
    from agentrl.examples.search_r1.data import SEARCH_R1_TEMPLATE, make_prompt
    from agentrl.examples.search_r1.world import gold_demo
    from agentrl.tools.search import RetrievalClient

    assert SEARCH_R1_TEMPLATE == PROMPT
    search_fn = RetrievalIndex(world.corpus).search_fn(topk=3)
    client = RetrievalClient(server.url, topk=3)
    tasks = [next(t for t in world.test if t["info"]["hops"] == h) for h in (1, 2)]
    try:
        for task in tasks:
            env = SearchEnv(retrieval_url=server.url, topk=3, retriever=client)
            assert await env.reset(task) == [{"role": "user", "content": make_prompt(task["prompt"])}]
            demo = gold_demo(task, search_fn)
            model_turns = [text for text, is_model in demo.segments if is_model]
            observations = [text for text, is_model in demo.segments if not is_model]
            for action, expected in zip(model_turns, observations, strict=False):
                result = await env.step(action)
                assert result.observation == expected and not result.terminated
            final = await env.step(model_turns[-1])
            assert final.terminated and final.info["answer"].strip() == task["label"][0]
            await env.close()
    finally:
        await client.close()


def test_bm25s_is_imported_with_jax_kept_off_the_gpu() -> None:
    """bm25s imports JAX when installed, and JAX then takes 75% of the GPU in that process; the index
    imports bm25s with ``JAX_PLATFORMS=cpu`` unless the user chose a platform."""
    code = (
        "import os\n"
        "from agentrl.examples.search_r1.retrieval_server import import_bm25s\n"
        "import_bm25s()\n"
        "print(os.environ.get('JAX_PLATFORMS'))\n"
    )

    def platforms(env: dict[str, str]) -> str:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    clean = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    assert platforms(clean) == "cpu"
    assert platforms({**clean, "JAX_PLATFORMS": "cuda"}) == "cuda"  # the user's choice stands


# ---- several workers on one port, and the server's own load


def _mapped_files(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}


async def _search_all(url: str, queries: list[str], connections: int) -> list[list[dict]]:
    """One query a request, all in flight at once over ``connections`` connections."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as s:

        async def one(q: str) -> list[dict]:
            async with s.post(
                f"{url}/retrieve", json={"queries": [q], "topk": 3, "return_scores": True}
            ) as r:
                assert r.status == 200
                return (await r.json())["result"][0]

        return await asyncio.gather(*(one(q) for q in queries))


def test_workers_share_one_port_and_one_mapped_index(corpus_file, world):
    queries = [t["prompt"] for t in world.test[:60]] * 2
    expected = RetrievalIndex(world.corpus).search(queries, 3)
    before = set(_children())
    with start_retrieval_server(corpus_file, workers=2) as s:
        assert len(set(s.pids)) == 2 and all(map(pid_alive, s.pids)) and s.info["workers"] == 2
        assert asyncio.run(_search_all(s.url, queries, connections=32)) == expected
        stats = httpx.get(f"{s.url}/stats").json()
        # the kernel spread the connections over both workers; /stats sums them whichever answered
        per_worker = [w["requests"] for w in stats["per_worker"]]
        assert stats["workers"] == 2 and all(n > 0 for n in per_worker)
        assert stats["requests"] == sum(per_worker) == len(queries) == stats["queries"]
        assert stats["inflight"] == 0 and stats["errors"] == 0
        # both map the same cached index files read-only: one copy in the page cache, not one each
        cache = f"{corpus_file}.bm25s/data.csc.index.npy"
        assert all(cache in _mapped_files(pid) for pid in s.pids)
        pids = s.pids
    assert not any(map(pid_alive, pids)) and set(_children()) <= before
    s.stop()  # idempotent


def test_stats_give_the_servers_load_over_a_window(corpus_file, world):
    from agentrl.examples.search_r1.retrieval_workers import RetrievalLoad

    with start_retrieval_server(corpus_file, workers=2) as s:
        load = RetrievalLoad(s.url + "/retrieve")  # the search tool's URL works too
        first = load.read()  # since the start: no requests yet
        assert first["retrieval/workers"] == 2 and first["retrieval/requests_per_s"] == 0
        asyncio.run(_search_all(s.url, [t["prompt"] for t in world.test[:80]], connections=16))
        assert httpx.post(f"{s.url}/retrieve", json={"queries": []}).status_code == 400
        figures = load.read()
        stats = s.stats()
    assert stats["requests"] == 80 and stats["errors"] == 1
    assert set(figures) == {
        "retrieval/workers",
        "retrieval/requests_per_s",
        "retrieval/busy_frac",
        "retrieval/request_ms_mean",
        "retrieval/queue_ms_mean",
        "retrieval/inflight_mean",
        "retrieval/inflight",
    }
    assert 0 < figures["retrieval/busy_frac"] <= 1 and figures["retrieval/requests_per_s"] > 0
    assert 0 <= figures["retrieval/queue_ms_mean"] <= figures["retrieval/request_ms_mean"] < 5000
    assert figures["retrieval/inflight_mean"] > 0 and figures["retrieval/inflight"] == 0
    # a server without /stats (here: none at all) gives no figures, and is not asked again
    from agentrl.cluster import free_port

    gone = RetrievalLoad(f"http://127.0.0.1:{free_port()}")
    assert gone.read() == {} and gone.read() == {}


def test_cli_starts_and_stops_its_workers(corpus_file):
    server = [
        sys.executable,
        "-m",
        "agentrl.examples.search_r1.retrieval_server",
        "--corpus",
        str(corpus_file),
    ]
    proc = subprocess.Popen(
        [*server, "--port", "0", "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        info = json.loads(proc.stdout.readline())
        assert info["event"] == "ready" and len(info["pids"]) == 2 and proc.pid not in info["pids"]
        assert httpx.get(f"{info['url']}/health").json()["status"] == "ok"
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert not any(map(pid_alive, info["pids"]))


def test_the_recipe_logs_the_servers_load_each_step(corpus_file, world):
    """Search-R1's recipe reads the server's /stats once a step (``retrieval.url`` here: no Ray); the
    default worker count is one per engine."""
    from agentrl.examples.search_r1.recipe import SearchR1Recipe
    from agentrl.recipe import load_run_config
    from agentrl.types import Trajectory

    config = Path(__file__).resolve().parent.parent / "examples" / "search_r1" / "config.yaml"
    assert SearchR1Recipe(load_run_config(config, ["engine.num_engines=3"])).retrieval_workers() == 3
    assert SearchR1Recipe(load_run_config(config, ["retrieval.workers=2"])).retrieval_workers() == 2
    with start_retrieval_server(corpus_file, workers=2) as s:
        recipe = SearchR1Recipe(load_run_config(config, [f"retrieval.url={s.url}"]))
        assert recipe.start_services([])["retrieval_url"] == s.url
        asyncio.run(_search_all(s.url, [t["prompt"] for t in world.test[:20]], connections=4))
        traj = Trajectory(task_id="t", group_id="g", prompt_ids=[1], info={"num_searches": 2})
        figures = recipe.batch_metrics([traj])
    assert figures["batch/searches"] == 2 and figures["retrieval/workers"] == 2
    assert figures["retrieval/requests_per_s"] > 0 and 0 < figures["retrieval/busy_frac"] <= 1
