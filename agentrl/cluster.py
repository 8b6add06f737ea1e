"""Cluster glue: Ray actors that own the run's server processes (inference engines, tool servers).

A :class:`ServiceActor` starts one server process inside its actor (so Ray places it: an engine actor
asks for the GPUs its engine uses) and hands back the server's URL; ``stop()`` stops the process group.
The driver keeps every actor it started and stops them all in a ``finally`` (:func:`stop_all`), so a
Ctrl-C or an error leaves no server behind; the embedded engine and the retrieval server also exit on
their own when their parent dies. :func:`location` tells where a process runs (its Ray node).

:func:`start_ray` starts (or joins) Ray with its workers at normal priority and the user's code importable
in every one of them (:func:`user_code_env`, Ray's runtime environment); :func:`free_port` is the one way
agentrl picks a port for something it starts (servers, process-group rendezvous).

What a service runs is a picklable zero-argument ``start`` callable returning a handle with ``.url`` and
``.stop()`` (``start_embedded_server``, ``SGLangLauncher``, ``start_retrieval_server``...).

Hosts: a run's servers listen on loopback while the run sits on one host. When its Ray cluster spans
hosts, they listen on their node's routable address (:func:`node_address`) behind the run's secret, a
bearer key every client of the run is handed (:class:`Network`, :func:`open_network`). A server's
``host`` may be :data:`NODE`, resolved on the node where it starts (:func:`bind_address`).
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import secrets
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]"}
LOOPBACK = "127.0.0.1"
NODE = "node"  # a host value: the routable address of the node the server starts on
NODE_ADDRESS_ENV = "AGENTRL_NODE_ADDRESS"  # set on a node (its ray start's environment): its address
RUN_SECRET_ENV = "AGENTRL_RUN_SECRET"  # set for the driver: the run's secret (else one is generated)
# a local Ray instance starts no idle workers ahead of need (start_ray)
NO_PRESTART_ENV = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}
API_KEY_ENV = "AGENTRL_API_KEY"  # how a server the run starts gets its key (not on its command line)
Listen = Literal["auto", "loopback", "node"]


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_key_off_loopback(host: str, api_key: str | None) -> None:
    """Nothing listens unauthenticated off loopback: a ValueError when a server bound to ``host`` would
    have no key."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"host {host!r} is not loopback: an api_key is needed to serve there (or bind 127.0.0.1)"
        )


def node_address() -> str:
    """The address other hosts reach this node by: ``$AGENTRL_NODE_ADDRESS`` when the node sets it, else
    Ray's node IP (``ray start --node-ip-address`` sets that), else the address of the route out."""
    if address := os.environ.get(NODE_ADDRESS_ENV, "").strip():
        return address
    with contextlib.suppress(ImportError):
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent: a route is looked up
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return LOOPBACK


def bind_address(host: str) -> str:
    """The address a server binds for ``host``: :data:`NODE` becomes this node's (:func:`node_address`)."""
    return node_address() if host == NODE else host


def url_host(host: str) -> str:
    """``host`` as the host part of a URL others use: a wildcard bind is reached at this node's address,
    :data:`NODE` at the same; IPv6 in brackets."""
    if host in WILDCARD_HOSTS or host == NODE:
        host = node_address()
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def node_ips(nodes: Iterable[dict[str, Any]]) -> list[str]:
    """The distinct addresses of the alive nodes of ``ray.nodes()``, sorted."""
    return sorted({str(n["NodeManagerAddress"]) for n in nodes if n.get("Alive", True)})


@dataclass(frozen=True)
class Network:
    """How the run's servers are reached: the ``host`` they bind (:data:`LOOPBACK`, or :data:`NODE`: each
    one its node's routable address) and ``secret``, the bearer key each of them requires and every
    client sends (None: no key, on loopback only)."""

    host: str = LOOPBACK
    secret: str | None = field(default=None, repr=False)

    @property
    def spans_hosts(self) -> bool:
        return self.host != LOOPBACK


def bearer_matches(authorization: str, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <key>`` (compared in constant time)."""
    token = authorization[7:] if authorization.startswith("Bearer ") else ""
    return hmac.compare_digest(token.encode(), key.encode())


def open_network(listen: Listen, nodes: Iterable[dict[str, Any]], api_key: str | None = None) -> Network:
    """The run's :class:`Network` on a cluster of ``nodes`` (``ray.nodes()``). ``listen``: ``auto`` binds
    the node's address when the alive nodes have more than one address, loopback otherwise; ``node`` and
    ``loopback`` force one. Off loopback the servers need a key: ``api_key`` (``engine.api_key``) when set,
    else ``$AGENTRL_RUN_SECRET``, else a new random one for this run."""
    spans = len(node_ips(nodes)) > 1
    host = NODE if listen == "node" or (listen == "auto" and spans) else LOOPBACK
    secret = api_key
    if host == NODE and not secret:
        secret = os.environ.get(RUN_SECRET_ENV, "").strip() or secrets.token_urlsafe(32)
    return Network(host, secret)


def start_ray(
    address: str | None = None, num_cpus: int | None = None, runtime_env: dict[str, Any] | None = None
) -> None:
    """``ray.init`` for a run (a new local instance, or ``address`` of an existing cluster), with
    ``runtime_env`` as the job's runtime environment (:func:`user_code_env`: the user's modules in every
    worker).

    Workers run at the driver's priority. Ray starts them at niceness 15 by default, and every process
    they start inherits it: the engine, the trainer, the rollout and the env's servers then got about 3%
    of a core each against one busy process at niceness 0, so on a loaded machine a start-up or a Ctrl-C
    took minutes instead of seconds. ``RAY_worker_niceness`` set in the environment still wins.

    A local instance starts no idle workers ahead of need. Ray prestarts some when the first driver
    connects, but every actor of a run asks for the job's runtime environment and takes a worker of its
    own, so on a 2 vCPU machine the idle ones only cost CPU while the run starts (about 3 of a small run's
    45 CPU-seconds). The variables of :data:`NO_PRESTART_ENV` set in the environment still win; a
    cluster that is joined keeps its own settings.
    """
    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")
    if address in (None, "local"):
        for name, value in NO_PRESTART_ENV.items():
            os.environ.setdefault(name, value)
    ray.init(
        # None would join the cluster a `ray start` on this machine last recorded (even a dead one)
        address=address or "local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env=runtime_env or None,
    )


def user_code_env(
    names: Iterable[str] = (), cwd: str | Path | None = None, upload: bool = False
) -> dict[str, Any]:
    """The Ray runtime environment that lets every worker import the user's modules (envs, tools,
    verifiers, recipes) as the driver does, from its working directory ``cwd`` (default: the current one).

    * ``PYTHONPATH`` starts with ``cwd`` in every worker (then the node's own ``PYTHONPATH``): enough on the
      driver's host and on hosts that see the same path (a shared file system).
    * ``upload``: also the top-level modules of ``cwd`` that ``names`` point at (``"module:attr"`` names,
      e.g. ``my_env:UnitEnv`` -> ``./my_env.py`` or the package ``./my_env/``) go to every host as Ray
      ``py_modules``, so they import on hosts that do not share the driver's files. agentrl itself is
      installed on every node and is never uploaded.

    ``working_dir`` is not used: it would move the workers' working directory into a copy, and a run's
    relative paths (``output_dir``, checkpoints) must mean the same in the driver and in its workers.
    """
    root = Path(cwd or os.getcwd()).resolve()
    env: dict[str, Any] = {"env_vars": {"PYTHONPATH": f"{root}{os.pathsep}${{PYTHONPATH}}"}}
    if upload:
        modules = sorted({p for n in names if (p := _local_module(n, root)) is not None})
        if modules:
            env["py_modules"] = [str(p) for p in modules]
    return env


def _local_module(name: str, root: Path) -> Path | None:
    """``root/<top>.py`` or the package ``root/<top>/`` of a ``module:attr`` name's top-level module."""
    if ":" not in name:
        return None
    top = name.partition(":")[0].split(".")[0]
    if top == "agentrl" or not top.isidentifier():
        return None
    if (root / top / "__init__.py").is_file():
        return root / top
    return root / f"{top}.py" if (root / f"{top}.py").is_file() else None


def free_port(host: str = LOOPBACK) -> int:
    """A port that was free on ``host`` a moment ago (whoever needs it binds it shortly after)."""
    host = bind_address(host)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]") if host not in WILDCARD_HOSTS else "", 0))
        return int(s.getsockname()[1])


def location() -> dict[str, Any]:
    """Where the calling process runs: its Ray node's id and IP (None outside Ray) and its pid."""
    import ray

    node_id = node_ip = None
    if ray.is_initialized():
        node_id, node_ip = ray.get_runtime_context().get_node_id(), node_address()
    return {"node_id": node_id, "node_ip": node_ip, "pid": os.getpid()}


class ServiceHandle(Protocol):
    url: str

    def stop(self) -> None: ...


class ServiceWorker:
    """The actor body (usable without Ray too): one server process, its URL, and a stop."""

    def __init__(self, name: str, start: Callable[[], ServiceHandle]) -> None:
        self.name = name
        self._handle: ServiceHandle | None = start()

    def url(self) -> str:
        if self._handle is None:
            raise RuntimeError(f"service {self.name} is stopped")
        return self._handle.url

    def pid(self) -> int:
        return os.getpid()

    def location(self) -> dict[str, Any]:
        return location()

    def info(self) -> dict[str, Any]:
        """Its name, URL (None once stopped) and :func:`location`."""
        return {"name": self.name, "url": None if self._handle is None else self._handle.url, **location()}

    def stop(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            handle.stop()


def start_service(
    name: str,
    start: Callable[[], ServiceHandle],
    num_cpus: float = 0,
    num_gpus: float = 0,
    scheduling: Any = None,
    resources: dict[str, float] | None = None,
    wait: bool = True,
) -> Any:
    """A Ray actor running ``start()``; blocks until the server is up and returns the actor handle
    (``wait=False``: returns at once; ``actor.url.remote()`` then waits for it and surfaces a failure).
    ``scheduling``: a Ray scheduling strategy (a placement group's bundle, agentrl.placement);
    ``resources``: custom Ray resources the actor asks for (which nodes may take it)."""
    import ray

    options = {"scheduling_strategy": scheduling} if scheduling is not None else {}
    actor = (
        ray.remote(ServiceWorker)
        .options(name=None, num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, **options)
        .remote(name, start)
    )
    if wait:
        ray.get(actor.url.remote())  # surfaces a start failure here, with the server's log tail
    return actor


def stop_all(actors: list[Any], timeout: float = 60.0) -> None:
    """Stop every service actor (best effort, each independently), then kill the actors."""
    import ray

    for actor in reversed(actors):
        with contextlib.suppress(Exception):
            ray.get(actor.stop.remote(), timeout=timeout)
        with contextlib.suppress(Exception):
            ray.kill(actor)
    actors.clear()
