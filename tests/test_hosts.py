"""Several hosts, without a cluster: where the run's servers listen and with which key
(:func:`agentrl.cluster.open_network`), the servers' keys on the wire (the embedded engine and the Search-R1
retrieval server: a key off loopback, 401 without it, nothing secret on a command line), the checks of
what crosses hosts (a loopback URL used from another node, ``tensor`` across hosts, ``disk`` without a
shared file system) and the watch that turns a lost node into one line (:mod:`agentrl.node_watch`).

The run on two hosts that do not share a loopback is tests/test_multi_host.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentrl.cluster import (
    LOOPBACK,
    NODE,
    NODE_ADDRESS_ENV,
    RUN_SECRET_ENV,
    bind_address,
    node_address,
    open_network,
    url_host,
)
from agentrl.config import ConfigError
from agentrl.node_watch import NodeLost, lost_nodes, parts_by_node, watch_nodes
from agentrl.placement import check_shared_dir, in_memory_across_hosts, loopback_across_nodes


def _node(node_id: str, ip: str, alive: bool = True) -> dict[str, Any]:
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive, "Resources": {"CPU": 2.0}}


ONE_HOST = [_node("a" * 56, "10.1.0.1"), _node("b" * 56, "10.1.0.1")]  # two Ray nodes, one address
TWO_HOSTS = [_node("a" * 56, "10.1.0.1"), _node("b" * 56, "10.1.0.2"), _node("c" * 56, "10.1.0.9", False)]


# ---- where servers listen, and the run's secret --------------------------------------------------------
def test_one_host_listens_on_loopback_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_SECRET_ENV, raising=False)
    net = open_network("auto", ONE_HOST)
    assert (net.host, net.secret, net.spans_hosts) == (LOOPBACK, None, False)
    assert open_network("auto", ONE_HOST, api_key="k").secret == "k"  # engine.api_key is kept
    assert open_network("auto", TWO_HOSTS[:1] + TWO_HOSTS[2:]).host == LOOPBACK  # a dead node is no host


def test_several_hosts_listen_on_the_node_address_behind_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_SECRET_ENV, raising=False)
    a, b = open_network("auto", TWO_HOSTS), open_network("auto", TWO_HOSTS)
    assert a.host == NODE and a.spans_hosts
    assert a.secret and b.secret and a.secret != b.secret and len(a.secret) >= 40  # one per run
    assert a.secret not in repr(a)  # never printed with the record
    assert open_network("auto", TWO_HOSTS, api_key="mine").secret == "mine"
    monkeypatch.setenv(RUN_SECRET_ENV, "from-the-env")
    assert open_network("auto", TWO_HOSTS).secret == "from-the-env"
    assert open_network("node", ONE_HOST).host == NODE  # forced on one host too
    assert open_network("loopback", TWO_HOSTS).host == LOOPBACK


def test_node_address_comes_from_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_ADDRESS_ENV, "10.9.8.7")
    assert node_address() == "10.9.8.7" and bind_address(NODE) == "10.9.8.7"
    assert url_host(NODE) == url_host("0.0.0.0") == "10.9.8.7"
    assert bind_address("127.0.0.1") == "127.0.0.1" and url_host("::1") == "[::1]"
    monkeypatch.delenv(NODE_ADDRESS_ENV)
    assert node_address()  # the route out (or loopback on a machine without one)


def test_gloo_talks_over_the_interface_that_reaches_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gloo advertises the address the host name resolves to (loopback on many hosts) unless told an
    interface: the groups agentrl opens name the one the route to the rendezvous host leaves from."""
    import psutil

    from agentrl.engine.dist import gloo_interface, use_gloo_interface_for

    assert gloo_interface("127.0.0.1") is None and gloo_interface("::1") is None
    name = gloo_interface("10.255.255.1")  # any routed address: the route out of this machine
    if name is not None:  # a machine with no route out has nothing to choose
        assert name in psutil.net_if_addrs() and name != "lo"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    use_gloo_interface_for("127.0.0.1")
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # one host: gloo's own choice, as before
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    use_gloo_interface_for("10.255.255.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine"  # the user's setting wins


def test_listen_is_a_checked_field() -> None:
    from agentrl.recipe import load_run_config

    base = ["model_path=m", "data.path=d", "env.name=search", "recipe=default"]
    assert load_run_config(None, [*base, "ray.listen=node"]).ray.listen == "node"
    with pytest.raises(ConfigError, match=r"ray\.listen"):
        load_run_config(None, [*base, "ray.listen=everywhere"])
    with pytest.raises(ConfigError, match=r"ray\.rollout_resources: GPU is not a custom resource"):
        load_run_config(None, [*base, 'ray.rollout_resources={"GPU": 1}'])


# ---- what crosses hosts ----------------------------------------------------------------------------
def _placed(engine_url: str, retrieval_url: str, engine_node: str = "w", shard_node: str = "w") -> dict:
    at = {
        "h": {"node_id": "h" * 56, "node_ip": "10.1.0.1"},
        "w": {"node_id": "w" * 56, "node_ip": "10.1.0.2"},
    }
    return {
        "driver": at["h"],
        "engines": [{**at[engine_node], "url": engine_url}],
        "trainer_ranks": [at["h"]],
        "rollout_shards": [at[shard_node]],
        "services": [{**at["h"], "name": "retrieval", "url": retrieval_url}],
    }


def test_a_loopback_url_used_from_another_node_is_named() -> None:
    routable = _placed("http://10.1.0.2:3000", "http://10.1.0.1:8000")
    assert loopback_across_nodes(routable) is None
    problem = loopback_across_nodes(_placed("http://127.0.0.1:3000", "http://10.1.0.1:8000"))
    assert problem == "engine 0 at http://127.0.0.1:3000 (node wwwwwwww, 10.1.0.2) is used from node hhhhhhhh"
    problem = loopback_across_nodes(_placed("http://10.1.0.2:3000", "http://127.0.0.1:8000"))
    assert problem and problem.startswith("retrieval at http://127.0.0.1:8000 (node hhhhhhhh, 10.1.0.1)")
    # two Ray nodes of one host share its loopback
    same_host = _placed("http://127.0.0.1:3000", "http://127.0.0.1:8000")
    for part in (same_host["engines"][0], same_host["rollout_shards"][0]):
        part["node_ip"] = "10.1.0.1"
    assert loopback_across_nodes(same_host) is None
    # all on one node: loopback is right
    one = _placed("http://127.0.0.1:3000", "http://127.0.0.1:8000", engine_node="h", shard_node="h")
    assert loopback_across_nodes(one) is None


def test_tensor_across_hosts_is_refused_at_load() -> None:
    from agentrl.recipe import load_run_config

    base = ["model_path=m", "data.path=d", "env.name=search", "recipe=default", "weight_sync=tensor"]
    apart = ['ray.engine_resources={"engine_node": 1}', 'ray.trainer_resources={"trainer_node": 1}']
    with pytest.raises(ConfigError, match=r"weight_sync: tensor .* nodes of their own; use distributed"):
        load_run_config(None, base + apart)
    load_run_config(None, base)  # one machine: fine
    load_run_config(None, [*base[:-1], "weight_sync=distributed", *apart])


def test_in_memory_sync_between_hosts_is_named() -> None:
    placed = _placed("http://10.1.0.2:3000", "http://10.1.0.1:8000")
    assert in_memory_across_hosts(placed) == (
        "engine 0 runs on 10.1.0.2 and trainer rank 0 on 10.1.0.1; use distributed"
    )
    placed["engines"][0]["node_ip"] = "10.1.0.1"  # another Ray node of the trainer's host
    assert in_memory_across_hosts(placed) is None


async def test_disk_sync_needs_a_file_system_both_nodes_see(tmp_path: Path) -> None:
    """Each node a root of its own (no shared file system), then one root for both (a shared one): the
    marker trainer rank 0 writes is read back where the engines run, or the run is refused."""
    roots = {"h" * 56: tmp_path / "head", "w" * 56: tmp_path / "worker"}
    for root in roots.values():
        root.mkdir()
    placed = _placed("http://10.1.0.2:3000", "http://10.1.0.1:8000")

    async def on_node(node: str, fn: Any, path: str, *args: Any) -> Any:
        return fn(str(roots[node] / Path(path).relative_to("/")), *args)

    weights = Path("/run/weights")
    with pytest.raises(
        ConfigError, match=r"weight_sync: disk .* node wwwwwwww does not see; use distributed"
    ):
        await check_shared_dir(weights, placed, on_node)
    roots["w" * 56] = roots["h" * 56]
    await check_shared_dir(weights, placed, on_node)


# ---- keys on the wire ----------------------------------------------------------------------------------
def test_embedded_engine_off_loopback_requires_its_key(tiny_model_dir: Path) -> None:
    from agentrl.embedded.launch import start_embedded_server

    with pytest.raises(ValueError, match="not loopback: an api_key is needed"):
        start_embedded_server(tiny_model_dir, host="0.0.0.0")
    # with a key (on loopback here: what is checked is the key and the command line, not the route)
    with start_embedded_server(tiny_model_dir, host="127.0.0.1", api_key="s3cret") as server:
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert b"s3cret" not in cmdline  # the key is in the environment, not in the process list
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        assert httpx.post(server.url + "/generate", json=body, timeout=30).status_code == 401
        ok = httpx.post(server.url + "/generate", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200, ok.text
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # open for health checks


def test_retrieval_server_requires_the_key_it_was_given(tmp_path: Path) -> None:
    from agentrl.examples.search_r1.retrieval_workers import RetrievalLoad, start_retrieval_server
    from agentrl.tools.search import RetrievalClient

    corpus = tmp_path / "corpus.jsonl"
    docs = [{"id": str(i), "contents": f'"Title {i}"\nalpha beta {i}'} for i in range(20)]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    with start_retrieval_server(corpus, api_key="k3y") as server:
        assert all(b"k3y" not in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in server.pids)
        body = {"queries": ["alpha"], "topk": 2}
        assert httpx.post(server.url + "/retrieve", json=body, timeout=30).status_code == 401
        assert httpx.get(server.url + "/stats", timeout=30).status_code == 401
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200

        async def search(key: str | None) -> str:
            client = RetrievalClient(server.url, topk=2, api_key=key)
            try:
                return await client.search("alpha")
            finally:
                await client.close()

        assert "Doc 1(Title: " in asyncio.run(search("k3y"))
        with pytest.raises(Exception, match="401"):
            asyncio.run(search(None))
        assert "retrieval/requests_per_s" in RetrievalLoad(server.url, api_key="k3y").read()


# ---- a lost node --------------------------------------------------------------------------------------
PLACED = {
    "driver": {"node_id": "h" * 56, "node_ip": "10.1.0.1"},
    "engines": [{"node_id": "w" * 56, "node_ip": "10.1.0.2", "url": "http://10.1.0.2:1"}],
    "trainer_ranks": [{"node_id": "h" * 56, "node_ip": "10.1.0.1"}],
    "rollout_shards": [{"node_id": "w" * 56, "node_ip": "10.1.0.2"}],
    "services": [{"node_id": "h" * 56, "node_ip": "10.1.0.1", "name": "retrieval"}],
}


def test_lost_node_is_named_with_what_ran_there() -> None:
    assert parts_by_node(PLACED)["w" * 56] == ("10.1.0.2", ["engine 0", "rollout shard 0"])
    alive = [_node("h" * 56, "10.1.0.1"), _node("w" * 56, "10.1.0.2")]
    assert lost_nodes(PLACED, alive) is None
    gone = [alive[0], {**alive[1], "Alive": False}]
    assert lost_nodes(PLACED, gone) == (
        "lost node wwwwwwww (10.1.0.2), which ran engine 0, rollout shard 0: the run stops "
        "(resume it with --resume once the node is back)"
    )


async def test_watch_ends_a_waiting_loop_when_a_node_goes() -> None:
    nodes = [_node("h" * 56, "10.1.0.1"), _node("w" * 56, "10.1.0.2")]
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, lambda: nodes.__setitem__(1, {**nodes[1], "Alive": False}))
    t0 = loop.time()
    with pytest.raises(NodeLost, match=r"lost node wwwwwwww \(10\.1\.0\.2\), which ran engine 0"):
        async with watch_nodes(PLACED, poll=0.05, read_nodes=lambda: list(nodes)):
            await asyncio.sleep(60)  # a step that would wait on the lost node's parts
    assert loop.time() - t0 < 5
    assert not asyncio.current_task().cancelling()  # the watch's cancel does not leak to the caller


async def test_a_death_then_the_watch_firing_still_ends_in_the_line() -> None:
    """The body fails on a dead actor; while the run waits for Ray's word on the node, the watch's own poll
    sees it go: the run still ends with the lost-node line, not with a cancel."""
    import ray.exceptions

    nodes = [_node("h" * 56, "10.1.0.1"), _node("w" * 56, "10.1.0.2")]
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, lambda: nodes.__setitem__(1, {**nodes[1], "Alive": False}))
    with pytest.raises(NodeLost, match="which ran engine 0, rollout shard 0"):
        async with watch_nodes(PLACED, poll=0.05, grace=10, read_nodes=lambda: list(nodes)):
            await asyncio.sleep(0.25)
            raise ray.exceptions.RayActorError()
    assert not asyncio.current_task().cancelling()


async def test_an_actor_death_waits_for_the_node_and_other_errors_pass() -> None:
    import ray.exceptions

    nodes = [_node("h" * 56, "10.1.0.1"), _node("w" * 56, "10.1.0.2")]
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, lambda: nodes.__setitem__(1, {**nodes[1], "Alive": False}))
    with pytest.raises(NodeLost, match="which ran engine 0, rollout shard 0"):  # the death, then the node
        async with watch_nodes(PLACED, poll=30, grace=10, read_nodes=lambda: list(nodes)):
            raise ray.exceptions.RayActorError()

    async def answers(node_id: str) -> None:
        return None

    with pytest.raises(ValueError, match="a bug"):  # every node answers: the error as it was, at once
        async with watch_nodes(PLACED, poll=30, read_nodes=lambda: list(nodes[:1]), probe=answers):
            raise ValueError("a bug")

    # a call to a lost engine fails (connection refused) before Ray declares its node dead: the worker's
    # node does not answer the probe, and the run waits for Ray's word on it
    nodes = [_node("h" * 56, "10.1.0.1"), _node("w" * 56, "10.1.0.2")]
    loop.call_later(0.3, lambda: nodes.__setitem__(1, {**nodes[1], "Alive": False}))

    async def worker_silent(node_id: str) -> None:
        if node_id.startswith("w"):
            await asyncio.sleep(60)

    watch = watch_nodes(
        PLACED, poll=30, grace=10, read_nodes=lambda: list(nodes), probe=worker_silent, probe_timeout=0.5
    )
    with pytest.raises(NodeLost, match="which ran engine 0, rollout shard 0"):
        async with watch:
            raise ConnectionRefusedError("engine 0 unreachable")
    alive = [_node("h" * 56, "10.1.0.1"), _node("w" * 56, "10.1.0.2")]
    with pytest.raises(ray.exceptions.RayActorError):  # a death with every node alive: as it was
        async with watch_nodes(PLACED, poll=30, grace=0.2, read_nodes=lambda: alive, probe=answers):
            raise ray.exceptions.RayActorError()
